"""Exact block-wise top-k selection, fast on CPU and on GPU.

Every SparDL selection keeps the ``kb`` entries of a block with the largest ``|value|``, ties
going to the lower index (``docs/design.md``). ``lax.top_k`` does this but, on XLA:CPU, pays
to sort its output by every *selected* entry (``benchmarks/results/cpu_profile.md`` has the
figures), and on XLA:GPU sorts the whole row for a large ``k`` (a comparison sort for 2 to 26
rows). SparDL needs neither sorted output nor ``top_k``; it finds the exact ``kb``-th largest
key ``t``, keeps the entries above ``t`` and the ones equal to ``t`` in index order until
``kb`` are kept, and compacts them in ascending offset order. Three ways to find ``t``
(:data:`Method`), all exact and all giving the same positions:

* ``"count"`` (:func:`kth_largest`): bisection on the int32 bits of ``|value|`` (a monotone
  integer key for non-negative floats), 31 vectorised counting passes in a loop. The CPU's:
  each pass is a cheap vector reduction there.
* ``"radix"``: the key's 31 bits four at a time, most significant first; each pass counts
  the keys at or above 15 candidate thresholds at once, so 8 passes, unrolled (no loop, no
  branch, no sort: a few fused reductions on a GPU, where each launch and each loop step
  costs more than the reading).
* ``"sort"``: ``lax.top_k`` of the keys, positions sorted back (the GPU's choice before
  ``radix``; kept to compare against it).

**Two stages** (:func:`block_topk`): each block is cut into chunks of ``c`` entries; stage 1
selects the ``kb`` best chunks by their maximum, stage 2 selects ``kb`` entries among those
chunks only. Exact: order entries by (key desc, index asc); a chunk holding one of the top
``kb`` entries has its best entry among them, so at most ``kb - 1`` chunks rank before it.
With ``c ~ sqrt(m / kb)`` both stages see about ``sqrt(density) m`` keys instead of ``m``.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from spardl_jax._src.core import ints

__all__ = ['METHODS', 'default_method', 'chunk_size', 'keys', 'kth_largest',
           'kth_largest_in_chunks', 'GroupCounts', 'select', 'block_topk']

# Below this chunk size two stages save less than they cost.
_MIN_CHUNK = 4
_KEY_BITS = 31  # non-negative float32 keys fit in 31 bits
_GROUP = 8  # entries per group of the compaction's counts
_GROUPED_FROM = 1 << 14  # keys per row from which the grouped compaction pays


Method = Literal["count", "radix", "sort"]
METHODS = ("count", "radix", "sort")
_RADIX_BITS = 4  # key bits a radix pass decides: 2**4 - 1 thresholds counted at once
SORTED_UPTO = 4096  # keys per row up to which XLA:CPU's default is lax.top_k


def default_method(keys_per_row: int | None = None) -> Method:
  """How :func:`select` finds the top k on the default backend: ``"radix"`` on GPUs,
  ``"count"`` elsewhere (XLA:CPU counts 15 thresholds per pass about 10x slower than one:
  ``benchmarks/results/sync_methods.md``), except for rows of at most
  :data:`SORTED_UPTO` keys on XLA:CPU, where ``"sort"`` (``lax.top_k``) runs as fast (within
  0.2 ms a call) in a program of 25 operations instead of about 400, the top-k's share of
  a small model's compile (``benchmarks/results/compile_time.md``). Every device of a job
  runs the same backend and shapes, so all choose alike."""
  if jax.default_backend() == "gpu":
    return "radix"
  return "sort" if keys_per_row is not None and keys_per_row <= SORTED_UPTO else "count"


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


def kth_largest(k_: jax.Array, k: int, *, method: Method | None = None) -> jax.Array:
  """``(L,)``: the ``k``-th largest key of each row of ``k_`` ``(L, N)`` (exact)."""
  method = method or default_method(k_.shape[-1])
  if method == "radix":
    return _kth_largest_radix(k_, k)
  if method == "sort":
    magnitudes = jax.lax.bitcast_convert_type(k_, jnp.float32)
    return jax.lax.bitcast_convert_type(jax.lax.top_k(magnitudes, k)[0][:, -1], jnp.int32)

  def halve(_, bounds):
    lo, hi = bounds  # invariant: count(keys >= lo) >= k > count(keys > hi)
    mid = hi - ints.div(hi - lo, 2)  # upper middle, no int32 overflow
    enough = jnp.sum(k_ >= mid[:, None], axis=1, dtype=jnp.int32) >= k
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid - 1)

  # `*_like` keeps the keys' shard_map type (varying over the mesh axis) in the loop carry.
  bounds = (jnp.zeros_like(k_[:, 0]), jnp.full_like(k_[:, 0], 2**_KEY_BITS - 1))
  return jax.lax.fori_loop(0, _KEY_BITS, halve, bounds)[0]


def kth_largest_in_chunks(k_: jax.Array, k: int, *, method: Method | None = None) -> jax.Array:
  """:func:`kth_largest` in two stages, as :func:`block_topk` selects: the ``k`` largest
  chunk maxima of each row, then the ``k``-th largest key of those chunks (exact: ``k``
  chunks whose maxima are at least the ``k``-th largest maximum hold ``k`` keys at least that
  large, and every key above it lies in them). For a long row and a small ``k`` it reads the
  keys once and then two short rows, where :func:`kth_largest` counts the whole row once per
  key bit.

  Args:
    k_: ``(L, N)`` non-negative int32 keys.
    k: the rank, in ``[1, N]`` (static).
    method: :func:`select`'s method (``None``: :func:`default_method`).

  Returns:
    ``(L,)``: the same keys as :func:`kth_largest`.
  """
  rows, n = k_.shape
  chunk = chunk_size(n, k, method=method)
  if chunk == 1:
    return kth_largest(k_, k, method=method)
  # Zero keys pad the last chunk: they never rank above a real key, and where the k-th
  # largest is 0 the padding changes no count of keys above it.
  chunked = jnp.pad(k_, ((0, 0), (0, -n % chunk))).reshape(rows, -1, chunk)
  kc = min(k, chunked.shape[1])
  chunks = select(chunked.max(axis=-1), kc, method=method)  # (L, kc)
  entries = ints.get(chunked, (jnp.arange(rows, dtype=jnp.int32)[:, None], chunks))
  return kth_largest(entries.reshape(rows, kc * chunk), k, method=method)


def _kth_largest_radix(k_: jax.Array, k: int) -> jax.Array:
  """The ``k``-th largest key of each row, its bits decided :data:`_RADIX_BITS` at a time.

  Invariant: the ``prefix`` bits decided so far are those of ``t``, i.e. at least ``k`` keys
  lie at or above ``prefix`` followed by zeros. A pass counts the keys at or above each of
  the ``2**b - 1`` thresholds ``prefix, j, 0...`` (``j = 1 .. 2**b - 1``, ``b`` bits) in one
  read of the keys; the next ``b`` bits of ``t`` are the number of thresholds still counting
  at least ``k``.
  """
  prefix = jnp.zeros_like(k_[:, 0])
  left = _KEY_BITS
  while left:  # unrolled: a fixed 8 passes of 4, 4, ..., 4, 3 bits
    bits = min(_RADIX_BITS, left)
    left -= bits
    digits = jnp.arange(1, 2**bits, dtype=jnp.int32)
    thresholds = ((prefix[:, None] << bits) | digits) << left  # (L, 2**bits - 1)
    counts = jnp.sum(k_[:, :, None] >= thresholds[:, None, :], axis=1, dtype=jnp.int32)
    prefix = (prefix << bits) | jnp.sum(counts >= k, axis=1, dtype=jnp.int32)
  return prefix


def _compact(take: jax.Array, k: int, *, search: str = "scan") -> jax.Array:
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
    out = jnp.zeros((rows * (k + 1),), jnp.int32).at[flat].set(source, mode="drop",
                                                               wrap_negative_indices=False)
    return out.reshape(rows, k + 1)[:, :k]
  slots = jnp.arange(k, dtype=jnp.int32)
  return jax.vmap(lambda row: GroupCounts.of(row, _GROUP).nth(slots, search=search))(take)


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
    at = jnp.minimum(ints.div(positions, width), self.groups.shape[0] - 1)
    window, start = self._group(at)
    lanes = jnp.arange(width, dtype=jnp.int32)
    return start + jnp.sum(window & (lanes[None] < (positions - at * width)[:, None]), axis=1,
                           dtype=jnp.int32)

  def nth(self, ranks: jax.Array, *, search: str = "scan") -> jax.Array:
    """``(R,)`` int32 index of the True entry with ``ranks`` True entries before it (ranks
    at or past the total give an arbitrary index: mask them). ``search`` is
    ``jnp.searchsorted``'s method: its loop (``"scan"``), or ``"scan_unrolled"`` where a
    loop step costs more than its work (a GPU waits on the host for each)."""
    width = self.groups.shape[1]
    at = jnp.minimum(jnp.searchsorted(self.ends, ranks, side="right", method=search),
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
    method: one of :data:`METHODS` (see the module's docstring); all give the same
      positions. ``None``: :func:`default_method`.

  Returns:
    ``(L, k)`` int32 positions in ascending order.
  """
  method = method or default_method(k_.shape[-1])
  if method == "sort":
    # The keys are the bits of non-negative float32s: as floats they order alike (NaN above
    # inf, as lax.top_k ranks it), and XLA's TopK is fast for floats but not for int32.
    magnitudes = jax.lax.bitcast_convert_type(k_, jnp.float32)
    return jnp.sort(jax.lax.top_k(magnitudes, k)[1], axis=-1)
  t = kth_largest(k_, k, method=method)[:, None]
  above = k_ > t
  at_least = k_ >= t

  def ties_in_index_order():
    tied = at_least & ~above
    need = k - jnp.sum(above, axis=1, keepdims=True, dtype=jnp.int32)
    return above | (tied & (jnp.cumsum(tied, axis=1, dtype=jnp.int32) <= need))

  if method == "radix":  # no loop, no branch: on a GPU each waits on the host
    return _compact(ties_in_index_order(), k, search="scan_unrolled")
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
  if chunk == 1:
    blocks = ints.get(buf, rows)  # (L, mc)
    offsets = select(keys(blocks), kb, method=method)
    return offsets, ints.take_along(blocks, offsets, axis=1)
  nc = mc // chunk
  chunked = buf.reshape(q, nc, chunk)
  kc = min(kb, nc)
  # Both stages read the rows straight from `buf`: the chunk maxima reduce the gathered rows
  # as they are read, and stage 2 gathers only the chosen chunks, so no copy of the L rows
  # (half the vector in SRS's first step) is ever written.
  # (L, kc), ascending
  chunks = select(keys(ints.get(chunked, rows)).max(axis=-1), kc, method=method)
  entries = ints.get(chunked, (rows[:, None], chunks)).reshape(-1, kc * chunk)
  pos = select(keys(entries), kb, method=method)
  offsets = (ints.take_along(chunks, ints.div(pos, chunk), axis=1) * chunk
             + ints.rem(pos, chunk))
  return offsets, ints.take_along(entries, pos, axis=1)
