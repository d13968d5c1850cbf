"""``--pieces``: the competitors' pieces, and the XLA:CPU operations they are built from
(sorts, binary searches, a prefix sum), each jitted alone on one device at the size of a
sync (``k = density · n``): the figures behind the pieces' shapes."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from spardl_jax._src.baselines import common, topkdsa
from spardl_jax._src.core import sparse

__all__ = ['WHAT', 'run_pieces', 'format_pieces']

# Each piece, and the code it times.
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


def _calls(n: int, k: int, seed: int) -> dict[str, tuple[Callable, tuple]]:
  """Each piece of :data:`WHAT` as a jitted function and its arguments: two rows of ``k``
  distinct ascending offsets below ``n`` with their values, and the vector they came from."""
  rng = np.random.default_rng(seed)
  g = jnp.asarray(rng.standard_normal(n).astype(np.float32))
  rows = np.sort(np.stack([rng.choice(n, k, replace=False) for _ in range(2)]), axis=1)
  offsets = jnp.asarray(rows.astype(np.int32))
  values = jnp.asarray(rng.standard_normal((2, k)).astype(np.float32))
  _, region, c, _ = topkdsa.sizes(8, n, topkdsa.TopkDSAConfig(density=k / n))
  crowded = jnp.arange(k, dtype=jnp.int32)  # every offset in region 0
  keys = jnp.asarray(rng.integers(0, 2**31 - 1, k).astype(np.int32))
  split = jax.jit(lambda o, v: topkdsa.split_by_region(o, v, region, 8, c))
  search = {method: jax.jit(lambda a, q, method=method: jnp.searchsorted(a, q, method=method))
            for method in ("scan", "scan_unrolled", "sort")}
  first, second = (offsets[0], values[0]), (offsets[1], values[1])
  return {
      "whole-vector top-k": (jax.jit(lambda x: common.local_topk(x, k)), (g,)),
      "sum of two rows of k pairs, any order": (jax.jit(sparse.sparse_sum), (offsets, values)),
      "sum of two rows of k pairs, ascending": (jax.jit(sparse.sorted_sum), (*first, *second)),
      "TopkDSA split, no region over capacity": (split, first),
      "TopkDSA split, every entry in one region": (split, (crowded, values[0])),
      "sort k int32": (jax.jit(jnp.sort), (keys,)),
      "sort k float32": (jax.jit(jnp.sort), (values[0],)),
      "argsort k float32": (jax.jit(jnp.argsort), (values[0],)),
      "top_k of k, by magnitude": (jax.jit(lambda x: jax.lax.top_k(jnp.abs(x), k)),
                                   (values[0],)),
      "searchsorted k into k, loop": (search["scan"], (offsets[0], offsets[1])),
      "searchsorted k into k, unrolled": (search["scan_unrolled"], (offsets[0], offsets[1])),
      "searchsorted k into k, by sorting": (search["sort"], (offsets[0], offsets[1])),
      "prefix sum of k": (jax.jit(jnp.cumsum), (keys,)),
  }


def run_pieces(args) -> list[dict]:
  """One row per (n, piece): every timed call in ms and their median, the pieces of one n
  interleaved (one warm-up round first) so that a slow spell of the machine falls on all."""
  rows = []
  for n in args.n:
    k = max(1, round(args.density * n))
    calls = _calls(n, k, args.seed)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(args.repeats + 1):
      for name, (fn, fn_args) in calls.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(*fn_args))
        if round_:
          times[name].append((time.perf_counter() - start) * 1e3)
    rows += [{"piece": name, "n": n, "k": k, "times_ms": t, "median_ms": statistics.median(t)}
             for name, t in times.items()]
  return rows


def format_pieces(rows: list[dict]) -> str:
  """A table per n of :func:`run_pieces`'s rows: each piece, what it times, its median."""
  tables = []
  for n in dict.fromkeys(r["n"] for r in rows):
    mine = [r for r in rows if r["n"] == n]
    lines = [f"| piece (n = {n:,}, k = {mine[0]['k']:,}) | what | ms (median of "
             f"{len(mine[0]['times_ms'])}) |", "| --- | --- | ---: |"]
    lines += [f"| {r['piece']} | {WHAT[r['piece']]} | {r['median_ms']:.1f} |" for r in mine]
    tables.append("\n".join(lines))
  return "\n\n".join(tables)
