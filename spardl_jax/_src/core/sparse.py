"""Sparse vectors as static-shape (offset, value) slots, shared by SparDL's Spar-All-Gather
and the baseline all-reduces (:mod:`spardl_jax._src.baselines.common` builds on them).

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

from spardl_jax._src.core import ints, messages, topk

__all__ = ['INVALID', 'Union', 'sparse_sum', 'sorted_sum', 'top_of_union', 'merge_with_partner',
           'magnitude_order', 'in_worker_order']

INVALID = np.iinfo(np.int32).max
_UNROLLED_FROM = 1 << 14  # sorted entries from which an unrolled binary search pays


class Union(NamedTuple):
  """A sparse sum: ``offsets`` ``(L,)`` int32 unique and ascending (empty slots
  :data:`INVALID` at the end), ``sums`` ``(L,)``, and ``count`` () int32 distinct offsets."""

  offsets: jax.Array
  sums: jax.Array
  count: jax.Array  # type: ignore[assignment]  # a field named count shadows tuple.count


def sparse_sum(offsets: jax.Array, values: jax.Array) -> Union:
  """Sums ``R`` sparse rows ``(R, h)`` (offsets unique within a row) in row order."""
  flat = jnp.sort(offsets.reshape(-1))
  first = jnp.concatenate([jnp.ones((1,), jnp.bool_), flat[1:] != flat[:-1]])
  first &= flat != INVALID
  unique = jnp.sort(jnp.where(first, flat, INVALID))
  sums = jnp.zeros(unique.shape, values.dtype)
  for row in range(offsets.shape[0]):  # Row order fixes the float sum on every worker.
    sums = sums.at[_find(unique, offsets[row])].add(values[row], mode="drop")
  return Union(unique, sums, jnp.sum(first, dtype=jnp.int32))


def _find(sorted_: jax.Array, queries: jax.Array) -> jax.Array:
  """``searchsorted(sorted_, queries)`` (left). For long arrays the unrolled binary search is
  about 2x the default loop's speed on XLA:CPU (10^5 queries; a sort-based search is 30x
  slower); short ones keep the loop, which compiles to fewer ops."""
  long = sorted_.shape[0] >= _UNROLLED_FROM
  return jnp.searchsorted(sorted_, queries, method="scan_unrolled" if long else "scan")


def sorted_sum(first_off: jax.Array, first_val: jax.Array, second_off: jax.Array,
               second_val: jax.Array) -> Union:
  """:func:`sparse_sum` of two rows whose offsets ascend (empty slots last), without a sort.

  Each entry's place in the union follows from binary searches into the other row: an
  entry of ``first`` at ``i`` with ``b`` entries of ``second`` below it lands at
  ``i + b`` less the duplicates among those ``b``. Sorting the ``2 L`` offsets twice, as
  :func:`sparse_sum` must for rows in any order, costs over twice as much on XLA:CPU
  (``spardl-bench --pieces``). The sums are the same bits: ``(0 + first) + second``.

  Args:
    first_off, first_val: ``(L1,)`` the row summed first.
    second_off, second_val: ``(L2,)`` the row summed second.

  Returns:
    The :class:`Union` of ``L1 + L2`` slots.
  """
  size = first_off.shape[0] + second_off.shape[0]
  last = first_off.shape[0] - 1
  below = _find(first_off, second_off)  # first-row entries below each second-row entry
  twin = (second_off != INVALID) & (first_off[jnp.minimum(below, last)] == second_off)
  twins_before = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                  jnp.cumsum(twin, dtype=jnp.int32)])
  under = _find(second_off, first_off)  # second-row entries below each first-row entry
  first_at = jnp.arange(first_off.shape[0], dtype=jnp.int32) + under - twins_before[under]
  first_at = jnp.where(first_off != INVALID, first_at, size)
  second_at = jnp.arange(second_off.shape[0], dtype=jnp.int32) + below - twins_before[:-1]
  second_at = jnp.where((second_off != INVALID) & ~twin, second_at, size)
  zero = jnp.zeros((), first_val.dtype)
  # A twin's value joins its first-row entry: both rows add into the same slot.
  twin_val = jnp.zeros(first_val.shape, first_val.dtype).at[
      jnp.where(twin, below, first_off.shape[0])].set(second_val, mode="drop")
  first_sum = (zero + first_val) + twin_val
  at = jnp.concatenate([first_at, second_at])
  offsets = jnp.full((size,), INVALID, jnp.int32).at[at].set(
      jnp.concatenate([first_off, second_off]), mode="drop")
  sums = jnp.zeros((size,), first_val.dtype).at[at].set(
      jnp.concatenate([first_sum, zero + second_val]), mode="drop")
  count = (jnp.sum(first_off != INVALID, dtype=jnp.int32)
           + jnp.sum(second_at < size, dtype=jnp.int32))
  return Union(offsets, sums, count)


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
    offsets, values: ``(k,)`` this worker's pairs, offsets ascending (empty slots last).
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
  union = sorted_sum(jnp.where(mine_first, offsets, theirs_off[0]),
                     jnp.where(mine_first, values, theirs_val[0]),
                     jnp.where(mine_first, theirs_off[0], offsets),
                     jnp.where(mine_first, theirs_val[0], values))
  kept_off, kept_val, kept = top_of_union(union, k)
  return kept_off, kept_val, union, (union.offsets != INVALID) & ~kept


def magnitude_order(values: jax.Array) -> jax.Array:
  """Indices ordering ``values`` by decreasing ``|value|`` (the selection keys of
  :func:`spardl_jax._src.core.topk.keys`), ties to the lower index."""
  return jnp.argsort(-topk.keys(values), stable=True)


def in_worker_order(rows: jax.Array, rank: jax.Array) -> jax.Array:
  """Rows gathered in the rotated frame (row ``j`` from worker ``rank + j``) -> worker order."""
  p = rows.shape[0]
  return rows[ints.rem(jnp.arange(p, dtype=jnp.int32) + (p - rank), p)]
