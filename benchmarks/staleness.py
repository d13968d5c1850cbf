"""How much of the mean gradient a sparse sync has delivered, against P: the model behind the
density rule (``density="auto"``).

python -m benchmarks.staleness --p 8,16,32,64 --densities 0.01,0.025,0.05

Runs the NumPy models the tests hold the library to (SparDL's and TopkA's books, error
feedback included) for ``--steps`` syncs of ``n`` entries. Each step's gradients are a
drifting heavy-tailed signal, the same on every device, plus independent noise per device
whose variance grows with P, as at a fixed global batch (each device sees 1/P of it). After
each step it compares what the sync delivered so far with the true mean gradient so far:

  lag = |sum of the mean gradients - sum of the updates| / |sum of the mean gradients|

(0: nothing waits; 1: nothing arrived), the mean over the last ``--steps // 4`` steps, and the
update's nonzeros. A method whose lag grows with P delivers less of each step as P grows,
which costs steps to accuracy; the rule grows SparDL's density to hold it.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from benchmarks.cli import add_progress, comma_list, fraction
from spardl_jax.tools.progress import bar
from tests import reference, reference_baselines

__all__ = ['lag', 'main']

METHODS = {"spardl": reference.spardl, "topka": reference_baselines.topka}


def lag(method: str, p: int, density: float, *, n: int, steps: int, seed: int = 0
        ) -> tuple[float, float]:
  """``(lag, mean nonzeros of the update)`` of ``method`` at ``p`` devices (see above)."""
  rng = np.random.default_rng(seed)
  signal = (0.1 * rng.standard_t(3, n)).astype(np.float32)
  residuals = np.zeros((p, n), np.float32)
  true, sent = np.zeros(n), np.zeros(n)
  lags, nonzeros = [], []
  for _ in range(steps):
    drift = signal * (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)
    xs = drift[None] + (0.1 * np.sqrt(p / 8) * rng.standard_normal((p, n))).astype(np.float32)
    y, residuals = METHODS[method](xs, residuals, density)
    y = y[0] if y.ndim == 2 else y
    true += xs.astype(np.float64).mean(0)
    sent += y
    lags.append(np.linalg.norm(true - sent) / np.linalg.norm(true))
    nonzeros.append(np.count_nonzero(y))
  tail = max(1, steps // 4)
  return float(np.mean(lags[-tail:])), float(np.mean(nonzeros[-tail:]))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.staleness", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--p", type=comma_list(int, "a comma list of device counts"),
                      default=[8, 16, 32, 64])
  parser.add_argument("--densities", type=comma_list(fraction, "a comma list of densities"),
                      default=[0.01, 0.025, 0.05])
  parser.add_argument("--methods", type=comma_list(str, "a comma list of methods"),
                      default=["spardl", "topka"])
  parser.add_argument("--n", type=int, default=20_000)
  parser.add_argument("--steps", type=int, default=40)
  add_progress(parser)
  args = parser.parse_args(argv)
  unknown = [m for m in args.methods if m not in METHODS]
  if unknown:
    parser.error(f"--methods: unknown {unknown}; choose from {sorted(METHODS)}")
  print(f"lag after {args.steps} syncs (n = {args.n:,}); nonzeros of the update")
  print("| method | density | " + " | ".join(f"P = {p}" for p in args.p) + " |")
  print("| --- | --- |" + " --- |" * len(args.p))
  cells_of = [(m, d) for m in args.methods for d in args.densities]
  for method, density in bar(cells_of, desc="rows", unit="row", enabled=not args.no_progress):
    cells = [lag(method, p, density, n=args.n, steps=args.steps) for p in args.p]
    print(f"| {method} | {density:g} | " + " | ".join(
        f"{value:.3f} ({nz:,.0f})" for value, nz in cells) + " |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
