"""Packing sparse blocks into one static-shape message per communication step.

A message carries ``L`` blocks of ``kb`` (offset, value) pairs. Offsets are int32, values keep
the gradient's dtype; both are bit-cast to one unsigned word type and concatenated, so each
step is ONE ``ppermute`` (one collective-permute in the compiled program) whose byte size is
exactly ``L * kb * (4 + itemsize)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


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
  ``extra`` words (e.g. a count) into one ``(L, words)`` word array."""
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
  parts = (_from_words(message[:, :split], jnp.int32),
           _from_words(message[:, split:stop], dtype))
  if extra:
    parts += (_from_words(message[:, stop:], jnp.int32),)
  return parts
