"""Sparse vectors as static-shape (offset, value) slots, shared by SparDL's Spar-All-Gather
and the baseline all-reduces (:mod:`spardl_jax.baselines.common` builds on them).

A sparse vector is a pair of equal-length arrays: int32 offsets and values. Empty slots
carry the offset :data:`INVALID` (which sorts last and is dropped by ``mode='drop'``
scatters) and the value 0. Sums of several vectors are always taken in a fixed row order,
so every worker that sums the same rows gets bit-identical results.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spardl_jax.core import messages, topk

INVALID = np.iinfo(np.int32).max


class Union(NamedTuple):
  """A sparse sum: ``offsets`` ``(L,)`` int32 unique and ascending (empty slots
  :data:`INVALID` at the end), ``sums`` ``(L,)``, and ``count`` () int32 distinct offsets."""

  offsets: jax.Array
  sums: jax.Array
  count: jax.Array


def sparse_sum(offsets: jax.Array, values: jax.Array) -> Union:
  """Sums ``R`` sparse rows ``(R, h)`` (offsets unique within a row) in row order."""
  flat = jnp.sort(offsets.reshape(-1))
  first = jnp.concatenate([jnp.ones((1,), jnp.bool_), flat[1:] != flat[:-1]])
  first &= flat != INVALID
  unique = jnp.sort(jnp.where(first, flat, INVALID))
  sums = jnp.zeros(unique.shape, values.dtype)
  for row in range(offsets.shape[0]):  # Row order fixes the float sum on every worker.
    sums = sums.at[jnp.searchsorted(unique, offsets[row])].add(values[row], mode="drop")
  return Union(unique, sums, jnp.sum(first, dtype=jnp.int32))


def top_of_union(union: Union, kb: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The top-``kb`` entries of a sparse sum by ``|sum|``, ties to the lower offset.

  Returns:
    ``(offsets, values, kept)``: ``(kb,)`` ascending offsets (empty slots :data:`INVALID`)
    and their sums, and the ``(L,)`` bool mask of kept union slots.
  """
  size = union.offsets.shape[0]
  if size <= kb:
    pad = kb - size
    return (jnp.pad(union.offsets, (0, pad), constant_values=INVALID),
            jnp.pad(union.sums, (0, pad)), union.offsets != INVALID)
  # Empty slots sit last with key 0, so a real entry always wins a tie against them.
  keys = jnp.where(union.offsets != INVALID, topk.keys(union.sums), 0)
  pos = topk.select(keys[None], kb)[0]
  kept = jnp.zeros((size,), jnp.bool_).at[pos].set(True) & (union.offsets != INVALID)
  return union.offsets[pos], union.sums[pos], kept


def merge_with_partner(offsets: jax.Array, values: jax.Array, k: int, *, perm, axis_name,
                       mine_first=True, wire: messages.Wire = messages.EXACT
                       ) -> tuple[jax.Array, jax.Array, Union, jax.Array]:
  """One pairwise merge: send this worker's ``(k,)`` pairs along ``perm``, sum them with the
  pairs received, and keep the top-``k`` of the sum.

  Args:
    offsets, values: ``(k,)`` this worker's pairs.
    k: pairs per message.
    perm: the ``ppermute`` (source, target) pairs.
    axis_name: the mesh axis.
    mine_first: (bool or () bool) this worker's row comes first in the sum. Partners must
      agree on the order, so both compute the same bits.
    wire: the message format; ``values`` must already be as it carries them
      (``wire.round``), so both partners sum the same values.

  Returns:
    ``(offsets, values, union, dropped)``: the ``(k,)`` kept pairs (ascending), the sum, and
    the ``(L,)`` mask of its slots the top-``k`` discarded.
  """
  message = jax.lax.ppermute(wire.pack(offsets[None], values[None]), axis_name, perm=perm)
  theirs_off, theirs_val = wire.unpack(message, k, values.dtype)
  rows_off = jnp.where(mine_first, jnp.stack([offsets, theirs_off[0]]),
                       jnp.stack([theirs_off[0], offsets]))
  rows_val = jnp.where(mine_first, jnp.stack([values, theirs_val[0]]),
                       jnp.stack([theirs_val[0], values]))
  union = sparse_sum(rows_off, rows_val)
  kept_off, kept_val, kept = top_of_union(union, k)
  return kept_off, kept_val, union, (union.offsets != INVALID) & ~kept


def magnitude_order(values: jax.Array) -> jax.Array:
  """Indices ordering ``values`` by decreasing ``|value|`` (the selection keys of
  :func:`spardl_jax.topk.keys`), ties to the lower index."""
  return jnp.argsort(-topk.keys(values), stable=True)


def in_worker_order(rows: jax.Array, rank: jax.Array) -> jax.Array:
  """Rows gathered in the rotated frame (row ``j`` from worker ``rank + j``) -> worker order."""
  p = rows.shape[0]
  return rows[(jnp.arange(p, dtype=jnp.int32) - rank) % p]
