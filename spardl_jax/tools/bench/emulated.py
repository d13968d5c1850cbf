"""``--emulate``: each method's whole sync timed on ONE device with the ``P`` ranks batched
by ``jax.vmap`` (its collectives become gathers and permutations in the device's memory)."""

from __future__ import annotations

import sys

import jax
import numpy as np

from spardl_jax.tools.bench.common import median_seconds, variants

__all__ = ['run_emulated', 'format_emulated']


def run_emulated(args) -> list[dict]:
  """``--emulate``: each method's sync with ``P`` ranks batched on one device (``jax.vmap``
  with the axis name), timed; rows whose arrays exceed ``--max-memory-gb`` are skipped."""
  rows = []
  for p in args.devices:
    for n in args.n:
      if 8 * p * n * 4 > args.max_memory_gb * 2**30:
        print(f"P = {p}, n = {n:,}: over --max-memory-gb, skipped", file=sys.stderr)
        continue
      x = jax.random.normal(jax.random.key(args.seed), (p, n))
      for label, method, d in variants(args, p):
        state = jax.tree.map(lambda a, p=p: jax.numpy.broadcast_to(a, (p, *a.shape)),
                             method.init(n=n, dtype=x.dtype, p=p))
        fn = jax.jit(jax.vmap(lambda x, s, m=method: m.apply(x, s, axis_name="data"),
                              axis_name="data"))
        try:
          y, _ = jax.block_until_ready(fn(x, state))
        except AssertionError as error:  # vmap batches a ppermute only as a full permutation
          rows.append({"n": n, "devices": p, "method": label, "teams": d, "time_s": None,
                       "skipped": f"not emulable with jax.vmap: {error}"})
          continue
        same = bool(np.all(np.asarray(y) == np.asarray(y)[:1]))
        seconds = median_seconds(fn, x, state, args.repeats)
        rows.append({"n": n, "devices": p, "method": label, "teams": d,
                     "device": jax.devices()[0].device_kind, "time_s": seconds,
                     "per_rank_s": seconds / p, "identical_ranks": same})
  return rows


def format_emulated(rows: list[dict]) -> str:
  """The ``--emulate`` table, with each time against ``dense`` (``psum``) at the same size."""
  lines = ["| n | P | method | batched call (s) | per rank (s) | × psum | ranks identical |",
           "|---|---|---|---|---|---|---|"]
  dense = {(r["n"], r["devices"]): r["time_s"] for r in rows if r["method"] == "dense"}
  for r in rows:
    if r["time_s"] is None:
      lines.append(f"| {r['n']:,} | {r['devices']} | {r['method']} | {r['skipped']} | | | |")
      continue
    base = dense.get((r["n"], r["devices"]))
    ratio = f"{r['time_s'] / base:.1f}" if base else "-"
    lines.append(f"| {r['n']:,} | {r['devices']} | {r['method']} | {r['time_s']:.4f} | "
                 f"{r['per_rank_s']:.5f} | {ratio} | {r['identical_ranks']} |")
  return "\n".join(lines)
