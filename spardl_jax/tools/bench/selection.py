"""``--selection``: the top-k selection alone on one device, SparDL's exact block selection
with each method of :mod:`spardl_jax._src.core.topk` against ``lax.top_k``, ``lax.approx_max_k``
and one dense pass over the vector (the memory floor)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from spardl_jax._src.core import topk

__all__ = ['run_selection', 'format_selection']


def run_selection(args) -> list[dict]:
  """One row per (n, density): seconds per call of each selection and the dense pass.

  SparDL's selection (``core/topk.py``) runs with each method: ``count``, ``radix`` and
  ``sort`` in the two stages of the counting rule, ``sort`` also in one stage. ``default``
  names the one SparDL runs on this backend.
  """
  def ours(method, one_stage=False):
    def fn(x, k):
      chunk = 1 if one_stage else topk.chunk_size(x.shape[0], k, method="count")
      buf = jnp.pad(x, (0, -(-x.shape[0] // chunk) * chunk - x.shape[0]))[None]
      return topk.block_topk(buf, jnp.zeros((1,), jnp.int32), k, chunk, method=method)[0][0]
    return fn

  candidates = {
      "count": ours("count"),
      "radix": ours("radix"),
      "sort": ours("sort"),
      "sort_one_stage": ours("sort", one_stage=True),
      "top_k": lambda x, k: jax.lax.top_k(jnp.abs(x), k)[1],
      "approx_max_k": lambda x, k: jax.lax.approx_max_k(jnp.abs(x), k)[1],
      "dense_pass": lambda x, k: jnp.abs(x) * 2,
  }

  def default(n, k):
    if topk.default_method() != "sort":
      return topk.default_method()
    return "sort_one_stage" if topk.chunk_size(n, k) == 1 else "sort"

  rows = []
  for n in args.n:
    x = jax.random.normal(jax.random.key(args.seed), (n,), jnp.float32)
    for density in args.densities:
      k = max(1, int(np.ceil(density * n)))
      row = {"n": n, "density": density, "k": k, "backend": jax.default_backend(),
             "default": default(n, k)}
      outputs = {}
      for name, fn in candidates.items():
        compiled = jax.jit(fn, static_argnums=1).lower(x, k).compile()
        outputs[name] = jax.block_until_ready(compiled(x))  # warm-up
        times = []
        for _ in range(args.repeats):
          start = time.perf_counter()
          jax.block_until_ready(compiled(x))
          times.append(time.perf_counter() - start)
        row[f"{name}_s"] = statistics.median(times)
      want = np.sort(np.asarray(outputs["top_k"]))
      row["exact"] = all(np.array_equal(np.asarray(outputs[name]), want)
                         for name in ("count", "radix", "sort", "sort_one_stage"))
      rows.append(row)
      print(format_selection([row]).splitlines()[-1], flush=True)
  return rows


def format_selection(rows: list[dict]) -> str:
  """The ``--selection`` table: each selection's median seconds per call, ``lax.top_k``'s
  over SparDL's default's, and whether ours returned exactly ``lax.top_k``'s indices."""
  lines = ["| n | density | k | SparDL count (s) | SparDL radix (s) | SparDL sort (s) | sort, "
           "one stage (s) | lax.top_k (s) | lax.approx_max_k (s) | dense pass (s) | top_k / "
           "SparDL default | exact |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    mine = r[f"{r['default']}_s"]
    lines.append(f"| {r['n']:,} | {r['density']:g} | {r['k']:,} | {r['count_s']:.4f} | "
                 f"{r['radix_s']:.4f} | {r['sort_s']:.4f} | {r['sort_one_stage_s']:.4f} | "
                 f"{r['top_k_s']:.4f} | "
                 f"{r['approx_max_k_s']:.4f} | {r['dense_pass_s']:.4f} | "
                 f"{r['top_k_s'] / mine:.1f}x ({r['default']}) | {r['exact']} |")
  return "\n".join(lines)
