"""Exact block-wise top-k selection, fast on CPU and on GPU.

Every SparDL selection keeps the ``kb`` entries of a block with the largest ``|value|``, ties
going to the lower index (``docs/design.md``). ``lax.top_k`` does this but, on XLA:CPU, pays
to sort its output by every *selected* entry (``benchmarks/results/cpu_profile.md`` has the
figures).
SparDL needs neither sorted output nor ``top_k``:

* **Threshold selection** (:func:`select`): bisection on the int32 bits of ``|value|`` (a
  monotone integer key for non-negative floats) finds the exact ``kb``-th largest key ``t``
  in 31 vectorised counting passes; entries above ``t`` are kept, entries equal to ``t`` in
  index order until ``kb`` are kept, and a prefix sum + scatter compacts them, in ascending
  offset order.
* **Two stages** (:func:`block_topk`): each block is cut into chunks of ``c`` entries; stage 1
  selects the ``kb`` best chunks by their maximum, stage 2 selects ``kb`` entries among those
  chunks only. Exact: order entries by (key desc, index asc); a chunk holding one of the top
  ``kb`` entries has its best entry among them, so at most ``kb - 1`` chunks rank before it.
  With ``c ~ sqrt(m / kb)`` both stages see about ``sqrt(density) m`` keys instead of ``m``.
* **On GPUs** the counting passes are small kernels launched one after another (about 60 for
  a two-stage selection, a fixed cost whatever the size), while ``lax.top_k`` is one fused
  kernel, faster there (``benchmarks/results/sync_methods.md``, "On a GPU"). There :func:`select`
  takes ``lax.top_k`` of the keys (equal keys: the lower index first, the same set) and
  sorts the positions back into ascending order (``method="sort"``).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ['default_method', 'chunk_size', 'keys', 'kth_largest', 'GroupCounts', 'select',
           'block_topk']

# Below this chunk size two stages save less than they cost.
_MIN_CHUNK = 4
_KEY_BITS = 31  # non-negative float32 keys fit in 31 bits
_GROUP = 8  # entries per group of the compaction's counts
_GROUPED_FROM = 1 << 14  # keys per row from which the grouped compaction pays


Method = Literal["count", "sort"]


def default_method() -> Method:
  """How :func:`select` finds the top k on the default backend: ``"sort"`` (``lax.top_k``)
  on GPUs, ``"count"`` (bisection on the keys) elsewhere. Measured on XLA:CPU and an H100
  (``benchmarks/results/sync_methods.md``); every device of a job runs the same backend, so
  all choose alike."""
  return "sort" if jax.default_backend() == "gpu" else "count"


def chunk_size(m: int, kb: int, *, method: Method | None = None) -> int:
  """Chunk length ``c`` for blocks of ``m`` entries keeping ``kb``: 1 means one stage.

  Prefers a divisor of ``m`` near the optimum ``sqrt(m / kb)`` so no padding is needed.
  With ``method="sort"`` (``None``: :func:`default_method`) blocks keeping 1 % or more take
  one stage: ``lax.top_k``'s cost grows with ``k``, and two stages select ``kb`` twice, which
  pays only for small ``kb`` (measured on an H100: ``benchmarks/results/sync_methods.md``,
  "On a GPU").
  """
  best = math.sqrt(m / kb)
  if best < _MIN_CHUNK or ((method or default_method()) == "sort" and 100 * kb >= m):
    return 1
  lo, hi = max(_MIN_CHUNK, int(best / 2)), int(best * 2)
  divisors = [c for c in range(lo, hi + 1) if m % c == 0]
  if divisors:
    return min(divisors, key=lambda c: abs(math.log(c / best)))
  return round(best)


def keys(values: jax.Array) -> jax.Array:
  """int32 selection keys: the float32 bits of ``|values|``, ordered like ``|values|``.

  NaN ranks above inf (as in ``lax.top_k``); ``-0.0`` and ``0.0`` tie.
  """
  return jax.lax.bitcast_convert_type(jnp.abs(values).astype(jnp.float32), jnp.int32)


def kth_largest(k_: jax.Array, k: int) -> jax.Array:
  """``(L,)``: the ``k``-th largest key of each row of ``k_`` ``(L, N)`` (exact bisection)."""
  def halve(_, bounds):
    lo, hi = bounds  # invariant: count(keys >= lo) >= k > count(keys > hi)
    mid = hi - (hi - lo) // 2  # upper middle, no int32 overflow
    enough = jnp.sum(k_ >= mid[:, None], axis=1, dtype=jnp.int32) >= k
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

  # `*_like` keeps the keys' shard_map type (varying over the mesh axis) in the loop carry.
  bounds = (jnp.zeros_like(k_[:, 0]), jnp.full_like(k_[:, 0], 2**_KEY_BITS - 1))
  return jax.lax.fori_loop(0, _KEY_BITS, halve, bounds)[0]


def _compact(take: jax.Array, k: int) -> jax.Array:
  """Positions of the ``k`` True entries of each row of ``take`` ``(L, N)``, ascending.

  For long rows a prefix sum over ``N`` and a scatter of ``N`` entries cost more on XLA:CPU
  than the selection itself (the prefix sum is a log-depth scan). There: counts per group of
  :data:`_GROUP` entries, a prefix sum over the ``N / 8`` groups, a binary search for the
  group of each output slot, and a count inside that group
  (``benchmarks/results/cpu_profile.md``). Short rows keep the prefix sum, which compiles to
  fewer ops.
  """
  rows, n = take.shape
  if n < _GROUPED_FROM:  # few keys: one prefix sum and scatter, fewer ops to compile
    slot = jnp.where(take, jnp.cumsum(take, axis=1, dtype=jnp.int32) - 1, k)
    flat = (slot + jnp.arange(rows, dtype=jnp.int32)[:, None] * (k + 1)).reshape(-1)
    source = jnp.tile(jnp.arange(n, dtype=jnp.int32), rows)
    out = jnp.zeros((rows * (k + 1),), jnp.int32).at[flat].set(source, mode="drop")
    return out.reshape(rows, k + 1)[:, :k]
  slots = jnp.arange(k, dtype=jnp.int32)
  return jax.vmap(lambda row: GroupCounts.of(row, _GROUP).nth(slots))(take)


class GroupCounts(NamedTuple):
  """The True entries of a bool vector ``(N,)`` counted per group of ``width``: rank queries
  cost one pass over the vector plus work per query, with no prefix sum over ``N`` (a
  log-depth scan on XLA:CPU). Serves the selection's compaction and Ok-Topk's split tables.

  Attributes:
    groups: ``(G, width)`` the vector, zero-padded to ``G * width``.
    ends: ``(G,)`` int32 True entries up to the end of each group.
  """

  groups: jax.Array
  ends: jax.Array

  @classmethod
  def of(cls, take: jax.Array, width: int) -> "GroupCounts":
    groups = jnp.pad(take, (0, -take.shape[0] % width)).reshape(-1, width)
    return cls(groups, jnp.cumsum(jnp.sum(groups, axis=1, dtype=jnp.int32), dtype=jnp.int32))

  def _group(self, at: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The ``(R, width)`` groups ``at`` and the True entries before each."""
    window = self.groups[at]
    return window, self.ends[at] - jnp.sum(window, axis=1, dtype=jnp.int32)

  def before(self, positions: jax.Array) -> jax.Array:
    """``(R,)`` int32: True entries at indices below each of ``positions`` (in ``[0, N]``)."""
    width = self.groups.shape[1]
    at = jnp.minimum(positions // width, self.groups.shape[0] - 1)
    window, start = self._group(at)
    lanes = jnp.arange(width, dtype=jnp.int32)
    return start + jnp.sum(window & (lanes[None] < (positions - at * width)[:, None]), axis=1,
                           dtype=jnp.int32)

  def nth(self, ranks: jax.Array) -> jax.Array:
    """``(R,)`` int32 index of the True entry with ``ranks`` True entries before it (ranks
    at or past the total give an arbitrary index: mask them)."""
    width = self.groups.shape[1]
    at = jnp.minimum(jnp.searchsorted(self.ends, ranks, side="right"),
                     self.groups.shape[0] - 1)
    window, start = self._group(at)
    # Inclusive counts inside each group by a triangular product (exact in float32 for any
    # width below 2**24), faster on XLA:CPU than a scan along the group for many queries.
    lanes = jnp.arange(width, dtype=jnp.int32)
    upto = window.astype(jnp.float32) @ (lanes[:, None] <= lanes[None, :]).astype(jnp.float32)
    passed = upto <= (ranks - start).astype(jnp.float32)[:, None]
    return at * width + jnp.sum(passed, axis=1, dtype=jnp.int32)


def select(k_: jax.Array, k: int, *, method: Method | None = None) -> jax.Array:
  """Exact top-``k`` of each row of int32 keys ``(L, N)``, ties to the lower position.

  Args:
    k_: ``(L, N)`` non-negative int32 keys (:func:`keys`, or 0 for an empty slot).
    k: positions to keep per row (static, at most ``N``).
    method: ``"count"`` (bisection and compaction) or ``"sort"`` (``lax.top_k``, positions
      sorted back); both give the same positions. ``None``: :func:`default_method`.

  Returns:
    ``(L, k)`` int32 positions in ascending order.
  """
  if (method or default_method()) == "sort":
    # The keys are the bits of non-negative float32s: as floats they order alike (NaN above
    # inf, as lax.top_k ranks it), and XLA's TopK is fast for floats but not for int32.
    magnitudes = jax.lax.bitcast_convert_type(k_, jnp.float32)
    return jnp.sort(jax.lax.top_k(magnitudes, k)[1], axis=-1)
  t = kth_largest(k_, k)[:, None]
  above = k_ > t
  at_least = k_ >= t

  def ties_in_index_order():
    tied = at_least & ~above
    need = k - jnp.sum(above, axis=1, keepdims=True, dtype=jnp.int32)
    return above | (tied & (jnp.cumsum(tied, axis=1, dtype=jnp.int32) <= need))

  # Usually every entry equal to t is kept; only then can one prefix sum be skipped.
  crowded = jnp.any(jnp.sum(at_least, axis=1, dtype=jnp.int32) > k)
  take = jax.lax.cond(crowded, ties_in_index_order, lambda: at_least)
  return _compact(take, k)


def block_topk(buf: jax.Array, rows: jax.Array, kb: int, chunk: int, *,
               method: Method | None = None) -> tuple[jax.Array, jax.Array]:
  """Top-``kb`` entries by ``|value|`` (ties to the lower offset) of some block rows.

  Args:
    buf: ``(q, mc)`` block buffer, any float dtype; ``mc`` a multiple of ``chunk``. Entries
      past the block length are zero padding: they never win, since a real entry of equal
      key has a lower offset and ``kb`` never exceeds the block length.
    rows: ``(L,)`` int32 rows to select from.
    kb: entries to keep per row (static).
    chunk: chunk length ``c`` from :func:`chunk_size` (static).
    method: :func:`select`'s method for both stages (``None``: :func:`default_method`).

  Returns:
    ``(offsets, values)``: ``(L, kb)`` int32 offsets inside each row, ascending, and the
    ``(L, kb)`` values there, in ``buf``'s dtype.
  """
  q, mc = buf.shape
  blocks = buf[rows]  # (L, mc)
  if chunk == 1:
    offsets = select(keys(blocks), kb, method=method)
    return offsets, jnp.take_along_axis(blocks, offsets, axis=1)
  nc = mc // chunk
  chunked = blocks.reshape(-1, nc, chunk)
  kc = min(kb, nc)
  chunks = select(keys(chunked).max(axis=-1), kc, method=method)  # (L, kc), ascending
  entries = jnp.take_along_axis(chunked, chunks[:, :, None], axis=1).reshape(-1, kc * chunk)
  pos = select(keys(entries), kb, method=method)
  offsets = jnp.take_along_axis(chunks, pos // chunk, axis=1) * chunk + pos % chunk
  return offsets, jnp.take_along_axis(entries, pos, axis=1)
