"""Packing sparse blocks into one static-shape message per communication step.

A message carries ``L`` blocks of ``kb`` (offset, value) slots, all of them concatenated
into one word array, so each step is ONE ``ppermute`` (one collective-permute in the compiled
program). Offsets inside a block are ascending, and empty slots (offset
:data:`~spardl_jax.core.sparse.INVALID`) come last. SparDL has two formats, :class:`Wire`:

* ``exact``: int32 offsets and values in the gradient's dtype, bit-cast to one unsigned word
  type: ``L * kb * (4 + itemsize)`` bytes.
* ``compact``: the low 16 bits of each offset, values in bfloat16 (float16 and bfloat16
  values travel unchanged), and per block the cumulative count of its slots below each
  multiple of 65,536 (``segments = ceil(span / 65,536)`` counts, uint16 when the block's slot
  count fits in 16 bits, else uint32). Ascending offsets make the counts recover the high
  bits, and the last count is the number of filled slots, so empty slots need no marker:
  ``L * (4 kb + segments * count_bytes)`` bytes. The sender rounds the values; the rounding
  error is the sender's to keep (``docs/design.md``, "Wire format").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ['SEGMENT', 'pack', 'unpack', 'segments', 'count_dtype', 'Wire', 'EXACT']

_WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
SEGMENT = 1 << 16  # offsets of a compact block travel as (segment, low 16 bits)
_INVALID = np.iinfo(np.int32).max  # sparse.INVALID (sparse imports this module)


def _word_dtype(dtype) -> np.dtype:
  return np.dtype(_WORDS[min(4, np.dtype(dtype).itemsize)])


def _to_words(x: jax.Array, word) -> jax.Array:
  """``(L, kb)`` -> ``(L, kb * r)`` words, ``r = itemsize / word size``."""
  w = jax.lax.bitcast_convert_type(x, word)
  return w.reshape(x.shape[0], -1)


def _from_words(w: jax.Array, dtype) -> jax.Array:
  r = np.dtype(dtype).itemsize // w.dtype.itemsize
  if r > 1:
    w = w.reshape(w.shape[0], -1, r)
  return jax.lax.bitcast_convert_type(w, dtype)


def pack(offsets: jax.Array, values: jax.Array, extra: jax.Array | None = None) -> jax.Array:
  """Pack ``(L, kb)`` int32 offsets, ``(L, kb)`` values and optionally ``(L, e)`` int32
  ``extra`` words (e.g. a count) into one ``(L, words)`` word array (the exact format)."""
  word = _word_dtype(values.dtype)
  parts = [_to_words(offsets, word), _to_words(values, word)]
  if extra is not None:
    parts.append(_to_words(extra, word))
  return jnp.concatenate(parts, axis=1)


def unpack(message: jax.Array, kb: int, dtype, extra: int = 0):
  """Inverse of :func:`pack`: ``(L, words)`` -> int32 offsets and values, each ``(L, kb)``,
  and, when ``extra > 0``, the ``(L, extra)`` int32 extra words as a third result."""
  word = message.dtype.itemsize
  split = kb * 4 // word
  stop = split + kb * np.dtype(dtype).itemsize // word
  parts: tuple[jax.Array, ...] = (_from_words(message[:, :split], jnp.int32),
                                  _from_words(message[:, split:stop], dtype))
  if extra:
    parts += (_from_words(message[:, stop:], jnp.int32),)
  return parts


def segments(span: int) -> int:
  """Cumulative counts a compact block of offsets in ``[0, span)`` carries."""
  return -(-span // SEGMENT)


def count_dtype(kb: int) -> np.dtype:
  """The dtype of a compact block's counts: they never exceed ``kb``."""
  return np.dtype(np.uint16 if kb < SEGMENT else np.uint32)


@dataclasses.dataclass(frozen=True)
class Wire:
  """The message format of one SparDL all-reduce (``SparDLConfig.wire``).

  Attributes:
    compact: False for the ``exact`` format, True for ``compact``.
    span: block length ``m``: every offset of a message lies in ``[0, span)``.
    kb: the most slots a block of this all-reduce carries (sizes the compact counts).
  """

  compact: bool = False
  span: int = 1
  kb: int = 1

  def value_dtype(self, dtype) -> np.dtype:
    """The dtype values of ``dtype`` travel in."""
    return np.dtype(jnp.bfloat16) if self.compact and np.dtype(dtype).itemsize > 2 else (
        np.dtype(dtype))

  def narrow(self, values: jax.Array) -> jax.Array:
    """``values`` in the dtype they travel in: rounded to nearest, except that a finite
    value beyond the narrow type's largest finite one is rounded toward zero to it
    (bfloat16's round to nearest turns float32 values from about 3.3961e38 up into inf,
    which every device would read as a non-finite gradient). The difference stays in the
    sender's residual like any rounding error (:meth:`rounding_error`)."""
    narrow = self.value_dtype(values.dtype)
    if narrow == values.dtype:
      return values
    out = values.astype(narrow)
    largest = jnp.asarray(jnp.finfo(narrow).max, narrow)
    return jnp.where(jnp.isinf(out) & jnp.isfinite(values),
                     jnp.where(values > 0, largest, -largest), out)

  def round(self, values: jax.Array) -> jax.Array:
    """``values`` as the receiver will see them (identity unless they are narrowed)."""
    return self.narrow(values).astype(values.dtype)

  def rounding_error(self, values: jax.Array) -> jax.Array | None:
    """``values - round(values)``, the part of a sent value its sender keeps; None when
    the format sends values unchanged."""
    if self.value_dtype(values.dtype) == values.dtype:
      return None
    return values - self.round(values)

  def pack(self, offsets: jax.Array, values: jax.Array,
           extra: jax.Array | None = None) -> jax.Array:
    """``(L, s)`` ascending int32 offsets (empty slots last), ``(L, s)`` values and optional
    ``(L, e)`` int32 ``extra`` words -> one ``(L, words)`` message."""
    if not self.compact:
      return pack(offsets, values, extra)
    bounds = jnp.arange(1, segments(self.span) + 1, dtype=jnp.int32) * SEGMENT
    # A binary search's loop only pays for long blocks; comparing all pairs compiles faster.
    method = "compare_all" if offsets.shape[1] * bounds.shape[0] <= 1 << 16 else "scan"
    counts = jax.vmap(lambda row: jnp.searchsorted(row, bounds, method=method))(offsets)
    parts = [(offsets & (SEGMENT - 1)).astype(jnp.uint16),
             _to_words(self.narrow(values), jnp.uint16),
             _to_words(counts.astype(count_dtype(self.kb)), jnp.uint16)]
    if extra is not None:
      parts.append(_to_words(extra, jnp.uint16))
    return jnp.concatenate(parts, axis=1)

  def unpack(self, message: jax.Array, kb: int, dtype, extra: int = 0):
    """Inverse of :meth:`pack` for ``kb`` slots per block: int32 offsets (empty slots
    :data:`~spardl_jax.core.sparse.INVALID`) and values in ``dtype``, each ``(L, kb)``, and
    the ``(L, extra)`` int32 words when ``extra > 0``."""
    if not self.compact:
      return unpack(message, kb, dtype, extra)
    segs = segments(self.span)
    stop = 2 * kb + segs * count_dtype(self.kb).itemsize // 2
    counts = _from_words(message[:, 2 * kb:stop], count_dtype(self.kb)).astype(jnp.int32)
    slots = jnp.arange(kb, dtype=jnp.int32)
    # Few segments: comparing every slot with every count beats a binary search's loop.
    method = "compare_all" if segs <= 64 else "scan_unrolled"
    segment = jax.vmap(lambda c: jnp.searchsorted(c, slots, side="right", method=method))(
        counts)
    offsets = jnp.where(segment < segs,
                        segment * SEGMENT + message[:, :kb].astype(jnp.int32), _INVALID)
    values = _from_words(message[:, kb:2 * kb], self.value_dtype(dtype)).astype(dtype)
    parts: tuple[jax.Array, ...] = (offsets, values)
    if extra:
      parts += (_from_words(message[:, stop:], jnp.int32),)
    return parts

  def block_bytes(self, slots, value_bytes: int):
    """Bytes of one block of ``slots`` (an int or a traced scalar) pairs."""
    if not self.compact:
      return slots * (4 + value_bytes)
    return 4 * slots + segments(self.span) * count_dtype(self.kb).itemsize


EXACT = Wire()
