"""Spar-Reduce-Scatter (SRS): the reduce-scatter half of SparDL, inside one team.

Executes :func:`spardl_jax._src.core.schedule.srs_schedule` with ``jax.lax.ppermute``: at each step a
worker sparsifies the blocks of its bag right before sending them (the paper's optimised
SRS), sends them as one packed message, and adds what it receives into its dense buffer.
After the last step it holds the summed block of its own rank (row ``rank`` of the buffer).

Everything a worker selected or received is logged, so that global residual collection
(:mod:`spardl_jax._src.core.gres`) can rebuild its residual without keeping a second dense buffer.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from spardl_jax._src.core import ints, messages, schedule, topk

__all__ = ['Receipt', 'SRSResult', 'flat_positions', 'spar_reduce_scatter']


class Receipt(NamedTuple):
  """Pairs a worker received in one SRS step, at flat positions of its block buffer.

  Attributes:
    positions: ``(L * kb,)`` int32 flat positions ``row * mc + offset`` in the buffer.
    before: ``(L * kb,)`` the buffer's values there just before the receipt was added.
  """

  positions: jax.Array
  before: jax.Array


class SRSResult(NamedTuple):
  """What SRS leaves on a worker.

  Attributes:
    buf: ``(q, mc)`` dense block buffer: ``g`` plus everything received.
    receipts: one :class:`Receipt` per SRS step, in step order.
    selected: ``((q - 1) * kb,)`` int32 flat positions of every entry this worker sent: its
      in-procedure residual is 0 there.
    errors: ``((q - 1) * kb,)`` the part of each sent value that did not travel (the
      wire's rounding error, in ``selected``'s order), or None when values travel unchanged.
    peak: () the largest ``|value|`` this worker sent (0 when it sent nothing).
  """

  buf: jax.Array
  receipts: list[Receipt]
  selected: jax.Array
  errors: jax.Array | None
  peak: jax.Array


def flat_positions(rows: jax.Array, offsets: jax.Array, mc: int) -> jax.Array:
  """``(L * kb,)`` positions ``row * mc + offset`` in the flat ``(q * mc,)`` block buffer."""
  return (rows[:, None] * mc + offsets).reshape(-1)


def spar_reduce_scatter(buf: jax.Array, *, kb: int, chunk: int, rank: jax.Array,
                        p: int, axis_name, wire: messages.Wire = messages.EXACT) -> SRSResult:
  """Runs SRS on one worker of a team of ``q = buf.shape[0]`` workers.

  Args:
    buf: ``(q, mc)`` the worker's ``g = x + residual`` in global block order (row ``b`` is
      block ``b``), zero-padded; any float dtype.
    kb: entries kept per block.
    chunk: chunk length for :func:`spardl_jax._src.core.topk.block_topk`.
    rank: int32 scalar, this worker's rank inside its team.
    p: number of workers on ``axis_name`` (a multiple of ``q``).
    axis_name: the mesh axis.
    wire: the message format; what a receiver adds is the value as the wire carries it.
  """
  q, mc = buf.shape
  receipts, selected, errors = [], [], []
  peak = jnp.zeros((), buf.dtype)
  for st in schedule.srs_schedule(q):
    # The rotated frame: position j of this worker is global block (rank + j) mod q.
    bag = ints.rem(rank + jnp.arange(st.start, st.stop, dtype=jnp.int32), q)
    offsets, values = topk.block_topk(buf, bag, kb, chunk)
    peak = jnp.maximum(peak, jnp.max(jnp.abs(values)))
    selected.append(flat_positions(bag, offsets, mc))
    errors.append(wire.rounding_error(values))
    message = jax.lax.ppermute(wire.pack(offsets, values), axis_name,
                               perm=schedule.team_permutation(p, q, st.shift))
    offsets, values = wire.unpack(message, kb, buf.dtype)
    rows = ints.rem(rank + jnp.arange(st.size, dtype=jnp.int32), q)
    positions = flat_positions(rows, offsets, mc)
    flat = buf.reshape(-1)
    before = ints.get(flat, positions)
    receipts.append(Receipt(positions, before))
    # A set of `before + value` (not an add) orders the scatter after the read of `before`,
    # so XLA updates the buffer in place instead of copying it. Positions never repeat.
    buf = flat.at[positions].set(before + values.reshape(-1), unique_indices=True,
                                 wrap_negative_indices=False).reshape(q, mc)
  kept = [e.reshape(-1) for e in errors if e is not None]  # all or none
  sent_errors = jnp.concatenate(kept) if kept else None
  return SRSResult(buf, receipts,
                   jnp.concatenate(selected) if selected else jnp.zeros((0,), jnp.int32),
                   sent_errors, peak)
