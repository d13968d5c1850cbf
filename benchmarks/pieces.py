"""What the competitors' pieces, and the XLA:CPU operations they are built from, cost on one
device: the figures behind the choices in ``benchmarks/results/cpu_profile.md``.

python -m benchmarks.pieces --out benchmarks/results/cpu_profile/pieces

Each piece is jitted alone on one device at the size of the main comparison (``--n``
entries, ``k = --density · n`` selected) and timed ``--repeats`` times after a warm-up, the
pieces interleaved so that a slow spell of the machine falls on all of them. The rows
(every call's time, the median, the commit, machine and versions) go to ``results.json``,
their table to ``results.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

from benchmarks import runs

# What each piece is, for the table: the code it times.
WHAT = {
    "whole-vector top-k": "`baselines.common.local_topk`: every baseline's selection",
    "sum of two rows of k pairs, any order": "`core.sparse.sparse_sum`: two sorts of 2k",
    "sum of two rows of k pairs, ascending": "`core.sparse.sorted_sum` (gTopk's merge, "
                                             "R-SAG): binary searches, no sort",
    "TopkDSA split, no region over capacity": "`baselines.topkdsa.split_by_region`, P = 8",
    "TopkDSA split, every entry in one region": "the same, each region picking its top c",
    "sort k int32": "`jnp.sort`",
    "sort k float32": "`jnp.sort`",
    "argsort k float32": "`jnp.argsort` (two operands)",
    "top_k of k, by magnitude": "`lax.top_k` of the whole length",
    "searchsorted k into k, loop": "`method='scan'`",
    "searchsorted k into k, unrolled": "`method='scan_unrolled'` (what `sparse_sum` and "
                                       "`sorted_sum` use from 2^14 entries)",
    "searchsorted k into k, by sorting": "`method='sort'`",
    "prefix sum of k": "`jnp.cumsum` (`sorted_sum` takes one)",
}


def pieces(n: int, k: int) -> dict[str, tuple[Callable, tuple]]:
  """Each piece of :data:`WHAT` as a jitted function and its arguments (made here, on the
  one device)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from spardl_jax.baselines import common, topkdsa
  from spardl_jax.core import sparse

  rng = np.random.default_rng(0)
  g = jnp.asarray(rng.standard_normal(n).astype(np.float32))
  rows = np.sort(np.stack([rng.choice(n, k, replace=False) for _ in range(2)]), axis=1)
  offsets, values = jnp.asarray(rows.astype(np.int32)), jnp.asarray(
      rng.standard_normal((2, k)).astype(np.float32))
  _, region, c, _ = topkdsa.sizes(8, n, topkdsa.TopkDSAConfig(density=k / n))
  crowded = jnp.arange(k, dtype=jnp.int32)  # every offset in region 0
  keys = jnp.asarray(rng.integers(0, 2**31 - 1, k).astype(np.int32))
  floats = values[0]
  split = jax.jit(lambda o, v: topkdsa.split_by_region(o, v, region, 8, c))
  search = {method: jax.jit(lambda a, q, method=method: jnp.searchsorted(a, q, method=method))
            for method in ("scan", "scan_unrolled", "sort")}
  return {
      "whole-vector top-k": (jax.jit(lambda x: common.local_topk(x, k)), (g,)),
      "sum of two rows of k pairs, any order": (jax.jit(sparse.sparse_sum), (offsets, values)),
      "sum of two rows of k pairs, ascending": (
          jax.jit(sparse.sorted_sum), (offsets[0], values[0], offsets[1], values[1])),
      "TopkDSA split, no region over capacity": (split, (offsets[0], values[0])),
      "TopkDSA split, every entry in one region": (split, (crowded, values[0])),
      "sort k int32": (jax.jit(jnp.sort), (keys,)),
      "sort k float32": (jax.jit(jnp.sort), (floats,)),
      "argsort k float32": (jax.jit(jnp.argsort), (floats,)),
      "top_k of k, by magnitude": (jax.jit(lambda x: jax.lax.top_k(jnp.abs(x), k)), (floats,)),
      "searchsorted k into k, loop": (search["scan"], (offsets[0], offsets[1])),
      "searchsorted k into k, unrolled": (search["scan_unrolled"], (offsets[0], offsets[1])),
      "searchsorted k into k, by sorting": (search["sort"], (offsets[0], offsets[1])),
      "prefix sum of k": (jax.jit(jnp.cumsum), (keys,)),
  }


def table(rows: list[dict]) -> str:
  """The Markdown table of :func:`measure`'s rows: each piece, what it times, its median."""
  first = rows[0]
  lines = [f"| piece (n = {first['n']:,}, k = {first['k']:,}) | what | ms (median of "
           f"{len(first['times_ms'])}) |", "| --- | --- | ---: |"]
  lines += [f"| {r['piece']} | {WHAT[r['piece']]} | {r['median_ms']:.1f} |" for r in rows]
  return "\n".join(lines)


def measure(n: int, k: int, repeats: int) -> list[dict]:
  """Every piece timed ``repeats`` times after one warm-up call, interleaved."""
  import jax

  calls = pieces(n, k)
  times: dict[str, list[float]] = {name: [] for name in calls}
  for round_ in range(repeats + 1):  # the first round compiles
    for name, (fn, args) in calls.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      if round_:
        times[name].append((time.perf_counter() - start) * 1e3)
  return [{"piece": name, "n": n, "k": k, "times_ms": t, "median_ms": statistics.median(t)}
          for name, t in times.items()]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.pieces", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--n", type=lambda v: int(float(v)), default=14_700_000,
                      help="entries of the vector (default 14.7M, the main comparison's)")
  parser.add_argument("--density", type=float, default=0.01,
                      help="k = density · n (default 0.01)")
  parser.add_argument("--repeats", type=int, default=9, help="timed calls per piece")
  parser.add_argument("--out", default=None, help="directory for results.json and results.md")
  args = parser.parse_args(argv)
  if args.n < 16:
    parser.error(f"--n must be at least 16, got {args.n}")
  if not 0 < args.density <= 0.5:
    parser.error(f"--density must be in (0, 0.5] (two rows of k distinct offsets), got "
                 f"{args.density}")
  if args.repeats < 1:
    parser.error(f"--repeats must be at least 1, got {args.repeats}")
  k = max(1, round(args.density * args.n))
  rows = measure(args.n, k, args.repeats)
  text = table(rows)
  print(text)
  if args.out:
    runs.write_rows(args.out, {"args": vars(args), **runs.provenance()}, rows, text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
