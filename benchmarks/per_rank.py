"""What one rank of a sync computes, timed alone on one device, beside the batched emulation.

python -m benchmarks.per_rank --ranks 8 --n 14.7e6 --methods spardl,oktopk,topka,dense

``spardl-bench --emulate`` runs the ``P`` ranks of a sync batched on one device
(``jax.vmap`` with the method's axis name) and divides the time by ``P``. That is not what a
rank runs: every selection there is a batch of ``P`` rows (on a GPU ``lax.top_k`` sorts 2 to
26 rows with a comparison sort, one row with a radix sort), and a ``lax.cond`` becomes a
select that runs both branches. Here the batched run only records what every collective
returned to every rank; then rank 0's own program, with each collective replaced by the
value it returned there (``axis_index`` is the rank, a run-time value as on a device), is
compiled and timed alone: the compute one rank of a real job does, its communication left
out. Its result is checked bit for bit against the batched run's.

The collectives are replaced by name in ``jax.lax`` while the method is traced (every method
of the library calls them as ``jax.lax.<name>``); a method that hides one elsewhere would be
timed with it, and its check would fail.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cli import add_progress
from spardl_jax import options
from spardl_jax.tools.progress import bar

__all__ = ['COLLECTIVES', 'batched', 'one_rank', 'measure', 'main']

COLLECTIVES = ("ppermute", "psum", "pmax", "pmean", "all_gather", "psum_scatter")


@contextlib.contextmanager
def _replaced(**functions):
  """``jax.lax``'s functions of these names replaced while tracing inside the block."""
  saved = {name: getattr(jax.lax, name) for name in functions}
  try:
    for name, function in functions.items():
      setattr(jax.lax, name, function)
    yield
  finally:
    for name, function in saved.items():
      setattr(jax.lax, name, function)


def batched(method, p: int):
  """The ``P`` ranks batched on one device: ``f(x, state) -> (y, state, returned)``, with
  ``returned`` what every collective gave every rank, in the order the method called them."""
  def ranks(x, state):
    returned = []

    def recording(name):
      real = getattr(jax.lax, name)

      def call(*args, **kwargs):
        out = real(*args, **kwargs)
        returned.append(out)
        return out
      return call

    with _replaced(**{name: recording(name) for name in COLLECTIVES}):
      y, state = method.apply(x, state, axis_name="data")
    return y, state, returned

  return jax.jit(jax.vmap(ranks, axis_name="data", axis_size=p))


def one_rank(method, p: int):
  """One rank's program: ``f(x, state, rank, returned) -> (y, state)``, each collective
  replaced by the value it returned to this rank."""
  def rank_program(x, state, rank, returned):
    replies = iter(returned)
    replay = {name: (lambda *args, **kwargs: next(replies)) for name in COLLECTIVES}
    with _replaced(**replay, axis_index=lambda axis_name: rank,
                   axis_size=lambda axis_name: p):
      return method.apply(x, state, axis_name="data")

  return jax.jit(rank_program)


def _median(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(spec: str, *, p: int, n: int, density: float, repeats: int, seed: int = 0) -> dict:
  """One method's batched time per rank and rank 0's own time, and whether they agree."""
  method = options.parse(spec, density=density).build(p)
  x = jax.random.normal(jax.random.key(seed), (p, n))
  state = jax.tree.map(lambda a: jnp.broadcast_to(a, (p, *a.shape)),
                       method.init(n=n, dtype=x.dtype, p=p))
  all_ranks = batched(method, p)
  y, _, returned = jax.block_until_ready(all_ranks(x, state))
  rank = 0
  mine = [r[rank] for r in returned]
  row = (x[rank], jax.tree.map(lambda a: a[rank], state), jnp.int32(rank), mine)
  alone = one_rank(method, p)
  y_alone, _ = alone(*row)
  return {"method": spec, "n": n, "devices": p, "device": jax.devices()[0].device_kind,
          "batched_per_rank_s": _median(all_ranks, (x, state), repeats) / p,
          "one_rank_s": _median(alone, row, repeats),
          "collectives": len(returned),
          "same_result": bool(np.array_equal(np.asarray(y_alone), np.asarray(y[rank])))}


def table(rows: list[dict]) -> str:
  """The rows as the Markdown table printed and published."""
  lines = ["| n | P | method | batched / P (ms) | one rank alone (ms) | collectives | same "
           "result |", "|---|---|---|---:|---:|---:|---|"]
  lines += [f"| {r['n']:,} | {r['devices']} | {r['method']} | "
            f"{r['batched_per_rank_s'] * 1e3:.2f} | {r['one_rank_s'] * 1e3:.2f} | "
            f"{r['collectives']} | {r['same_result']} |" for r in rows]
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.per_rank", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--ranks", type=int, default=8)
  parser.add_argument("--n", type=lambda v: [int(float(t)) for t in v.split(",")],
                      default=[14_700_000])
  parser.add_argument("--methods", default="dense,spardl,oktopk,topka,topkdsa",
                      help="comma list of method specs (gTopk's tree cannot be batched)")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", help="a JSON file for the rows")
  add_progress(parser)
  args = parser.parse_args(argv)
  rows = []
  print(table([]))
  jobs = [(n, spec) for n in args.n for spec in args.methods.split(",")]
  for n, spec in bar(jobs, desc="methods", unit="method", enabled=not args.no_progress):
    rows.append(measure(spec, p=args.ranks, n=n, density=args.density, repeats=args.repeats))
    print(table(rows[-1:]).splitlines()[-1], flush=True)
    if args.out:  # after every row: a run stopped by its time limit keeps what it measured
      with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=2)
  return 0 if all(r["same_result"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
