"""Packing sparse blocks into one static-shape message per communication step.

A message carries ``L`` blocks of ``kb`` (offset, value) slots, all of them concatenated
into one word array, so each step is ONE ``ppermute`` (one collective-permute in the compiled
program). Offsets inside a block are ascending, and empty slots (offset
:data:`~spardl_jax._src.core.sparse.INVALID`) come last. SparDL has two formats, :class:`Wire`:

* ``exact``: int32 offsets and values in the gradient's dtype, bit-cast to one unsigned word
  type: ``L * kb * (4 + itemsize)`` bytes.
* ``compact``: the low 16 bits of each offset, values in bfloat16 (float16 and bfloat16
  values travel unchanged), and per block the cumulative count of its slots below each
  multiple of 65,536 (``segments = ceil(span / 65,536)`` counts, uint16 when the block's slot
  count fits in 16 bits, else uint32). Ascending offsets make the counts recover the high
  bits, and the last count is the number of filled slots, so empty slots need no marker:
  ``L * (4 kb + segments * count_bytes)`` bytes.
* ``int8``, ``int4``, ``int2``: the compact format's offsets and counts, and per block the
  values as ``b``-bit signed integers ``q``, ``|q| <= 2^(b-1) - 1``, times one power-of-two
  scale ``2^e`` (the shared exponent of the OCP microscaling formats; one int16 word). For
  int8 and int4 ``e`` is the least exponent with ``(2^(b-1) - 1) 2^e >= max |v|`` over the
  block; int2's values are ``-2^e``, ``0`` and ``2^e`` with ``2^e`` in ``(max |v| / 2,
  max |v|]``, so its largest values clip to the scale rather than overshoot (a scale at or
  above the maximum sent fewer values, up to twice too large, and diverged in training). A
  power of two makes ``q 2^e`` exact and a second rounding of rounded values a no-op, so a
  subset of a block (B-SAG's top-``h``) or an agreed sum that is sent again keeps its bits.
  ``L * (2 kb + 2 ceil(kb b / 16) + 2 + segments * count_bytes)`` bytes.

The sender rounds the values; the rounding error is the sender's to keep (``docs/design.md``,
"Wire format").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ['SEGMENT', 'VALUE_BITS', 'pack', 'unpack', 'pack_fields', 'unpack_fields', 'segments',
           'count_dtype', 'Wire', 'EXACT']

_WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
SEGMENT = 1 << 16  # offsets of a compact block travel as (segment, low 16 bits)
_INVALID = np.iinfo(np.int32).max  # sparse.INVALID (sparse imports this module)
VALUE_BITS = {"int8": 8, "int4": 4, "int2": 2}  # the quantized formats' bits per value
_NONFINITE = np.int16(np.iinfo(np.int16).max)  # a block's exponent word: max |v| not finite
_EXPONENTS = (-126, 127)  # scales are normal float32 numbers


def _pow2(e: jax.Array) -> jax.Array:
  """``2^e`` as float32 for int32 ``e`` in [-126, 127], built from its bits (exact, where a
  power function need not be)."""
  return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


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


def pack_fields(fields: jax.Array, bits: int, word) -> jax.Array:
  """``(L, s)`` non-negative ints below ``2^bits`` -> ``(L, words)`` of the unsigned ``word``
  dtype, as many fields a word as fit (zero-padded), the first in the lowest bits."""
  per = 8 * np.dtype(word).itemsize // bits
  fields = jnp.pad(fields.astype(jnp.uint32), ((0, 0), (0, -fields.shape[1] % per)))
  shifts = jnp.arange(per, dtype=jnp.uint32) * bits
  # The fields' bits are disjoint: their sum is their OR.
  return jnp.sum(fields.reshape(fields.shape[0], -1, per) << shifts, axis=-1,
                 dtype=jnp.uint32).astype(word)


def unpack_fields(words: jax.Array, bits: int, count: int) -> jax.Array:
  """Inverse of :func:`pack_fields`: the first ``count`` fields of each row, int32."""
  per = 8 * words.dtype.itemsize // bits
  shifts = jnp.arange(per, dtype=jnp.uint32) * bits
  fields = (words.astype(jnp.uint32)[..., None] >> shifts) & (2 ** bits - 1)
  return fields.reshape(words.shape[0], -1)[:, :count].astype(jnp.int32)


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
    compact: False for the ``exact`` format, True for ``compact`` and the quantized ones
      (16-bit offsets and per-segment counts).
    span: block length ``m``: every offset of a message lies in ``[0, span)``.
    kb: the most slots a block of this all-reduce carries (sizes the compact counts).
    bits: bits per value of a quantized format (8, 4 or 2), 0 otherwise.
  """

  compact: bool = False
  span: int = 1
  kb: int = 1
  bits: int = 0

  def value_dtype(self, dtype) -> np.dtype:
    """The dtype values of ``dtype`` travel in (not quantized ones: see :attr:`bits`)."""
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

  def quantize(self, values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each block (the last axis) of ``values`` as ``bits``-bit integers and its exponent:
    ``(q, e)``, int32 ``q`` of ``values``' shape and int16 ``e`` with one entry per block
    (:data:`_NONFINITE` where the block holds a NaN or an inf)."""
    qmax = 2 ** (self.bits - 1) - 1
    v = values.astype(jnp.float32)
    top = jnp.max(jnp.abs(v), axis=-1, keepdims=True)
    _, e = jnp.frexp(top)  # 2^(e-1) <= top < 2^e
    if self.bits == 2:  # 2^e in (top / 2, top]: every value above half of it is sent
      e = e - 1
    else:  # the least exponent with qmax 2^e >= top (low, or low + 1)
      low = e - (qmax.bit_length() - 1) - 1
      e = jnp.where(qmax * _pow2(low) >= top, low, low + 1)
    # The largest scale whose largest value qmax 2^e is still a finite float32: a block of
    # values near float32's maximum is sent as qmax 2^e below it (the rest stays in the
    # sender's residual), never rounded up into inf.
    highest = int(np.floor(np.log2(float(np.finfo(np.float32).max) / qmax)))
    e = jnp.clip(e, _EXPONENTS[0], min(_EXPONENTS[1], highest))
    # ldexp, not a product with 2^-e: for e = 127 that factor is subnormal (the bits
    # _pow2 builds would read 0 and send a block of float32's largest values as zeros).
    q = jnp.clip(jnp.round(jnp.ldexp(v, -e)), -qmax, qmax).astype(jnp.int32)
    finite = jnp.isfinite(top)
    return jnp.where(finite, q, 0), jnp.where(finite, e, _NONFINITE).astype(jnp.int16)[..., 0]

  def dequantize(self, q: jax.Array, e: jax.Array, dtype) -> jax.Array:
    """Inverse of :meth:`quantize`: ``q 2^e`` in ``dtype`` (NaN for a non-finite block)."""
    e = e.astype(jnp.int32)[..., None]
    v = q.astype(jnp.float32) * _pow2(jnp.clip(e, *_EXPONENTS))
    return jnp.where(e == _NONFINITE, jnp.nan, v).astype(dtype)

  def round(self, values: jax.Array) -> jax.Array:
    """``values`` as the receiver will see them (identity unless they are narrowed); a
    quantized format scales each block, the last axis, on its own."""
    if self.bits:
      return self.dequantize(*self.quantize(values), values.dtype)
    return self.narrow(values).astype(values.dtype)

  def rounding_error(self, values: jax.Array) -> jax.Array | None:
    """``values - round(values)`` (blocks along the last axis), the part of a sent value its
    sender keeps; None when the format sends values unchanged."""
    if not self.bits and self.value_dtype(values.dtype) == values.dtype:
      return None
    return values - self.round(values)

  def _value_words(self, values: jax.Array) -> jax.Array:
    """``(L, s)`` values -> their ``(L, words)`` uint16 words in this format."""
    if not self.bits:
      return _to_words(self.narrow(values), jnp.uint16)
    q, e = self.quantize(values)
    words = pack_fields(q & (2 ** self.bits - 1), self.bits, jnp.uint16)  # two's complement
    return jnp.concatenate([words, _to_words(e[:, None], jnp.uint16)], axis=1)

  def _value_word_count(self, slots):
    """uint16 words of a compact block's ``slots`` values (an int or a traced scalar)."""
    if not self.bits:
      return slots
    return -(-slots * self.bits // 16) + 1  # and the exponent

  def _values_from_words(self, words: jax.Array, kb: int, dtype) -> jax.Array:
    if not self.bits:
      return _from_words(words, self.value_dtype(dtype)).astype(dtype)
    fields = unpack_fields(words[:, :-1], self.bits, kb)
    sign = 2 ** (self.bits - 1)
    q = (fields ^ sign) - sign
    return self.dequantize(q, _from_words(words[:, -1:], jnp.int16)[:, 0], dtype)

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
    parts = [(offsets & (SEGMENT - 1)).astype(jnp.uint16), self._value_words(values),
             _to_words(counts.astype(count_dtype(self.kb)), jnp.uint16)]
    if extra is not None:
      parts.append(_to_words(extra, jnp.uint16))
    return jnp.concatenate(parts, axis=1)

  def unpack(self, message: jax.Array, kb: int, dtype, extra: int = 0):
    """Inverse of :meth:`pack` for ``kb`` slots per block: int32 offsets (empty slots
    :data:`~spardl_jax._src.core.sparse.INVALID`) and values in ``dtype``, each ``(L, kb)``, and
    the ``(L, extra)`` int32 words when ``extra > 0``."""
    if not self.compact:
      return unpack(message, kb, dtype, extra)
    segs = segments(self.span)
    start = kb + self._value_word_count(kb)
    stop = start + segs * count_dtype(self.kb).itemsize // 2
    counts = _from_words(message[:, start:stop], count_dtype(self.kb)).astype(jnp.int32)
    slots = jnp.arange(kb, dtype=jnp.int32)
    # Few segments: comparing every slot with every count beats a binary search's loop.
    method = "compare_all" if segs <= 64 else "scan_unrolled"
    segment = jax.vmap(lambda c: jnp.searchsorted(c, slots, side="right", method=method))(
        counts)
    offsets = jnp.where(segment < segs,
                        segment * SEGMENT + message[:, :kb].astype(jnp.int32), _INVALID)
    values = self._values_from_words(message[:, kb:start], kb, dtype)
    parts: tuple[jax.Array, ...] = (offsets, values)
    if extra:
      parts += (_from_words(message[:, stop:], jnp.int32),)
    return parts

  def block_bytes(self, slots, value_bytes: int):
    """Bytes of one block of ``slots`` (an int or a traced scalar) pairs."""
    if not self.compact:
      return slots * (4 + value_bytes)
    counts = segments(self.span) * count_dtype(self.kb).itemsize
    return 2 * slots + 2 * self._value_word_count(slots) + counts


EXACT = Wire()
