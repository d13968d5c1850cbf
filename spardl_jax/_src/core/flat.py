"""Concatenating 1-D arrays into one flat vector without ``jnp.concatenate``.

XLA:CPU emits a concatenate (fused with its consumers) as a loop that picks the operand of
every output element, far slower than writing the same bytes as in-place slice updates of one
buffer (``benchmarks/results/cpu_profile.md`` has the figures: most of an ``mlp_wide`` train
step went there). The flat gradient of ``sync_gradients`` and PowerSGD's flat results use
:func:`concat` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ['concat', 'split']


def concat(parts: Sequence[jax.Array], dtype=None) -> jax.Array:
  """``jnp.concatenate([p.reshape(-1) for p in parts])`` cast to ``dtype`` (default: the
  first part's), written as ``dynamic_update_slice`` of a zero buffer."""
  dtype = dtype or parts[0].dtype
  flat = jnp.zeros((sum(p.size for p in parts),), dtype)
  start = 0
  for p in parts:
    flat = jax.lax.dynamic_update_slice(flat, p.astype(dtype).reshape(-1), (start,))
    start += p.size
  return flat


def split(flat: jax.Array, like: Sequence[Any]) -> list[jax.Array]:
  """:func:`concat`'s inverse: ``flat`` cut into arrays of ``like``'s shapes and dtypes (arrays,
  or anything with a ``shape``, ``size`` and ``dtype``)."""
  out, start = [], 0
  for x in like:
    out.append(flat[start:start + x.size].reshape(x.shape).astype(x.dtype))
    start += x.size
  return out
