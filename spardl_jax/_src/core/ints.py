"""Index arithmetic on integers that are never negative: positions, offsets, ranks.

``jnp``'s ``%`` and ``//`` follow Python's floor semantics and ``jnp.take_along_axis`` wraps
negative indices and masks out-of-bounds ones: each adds a handful of HLO instructions that
fix up a negative operand, and XLA copies them into every fusion that reads the result. In a
SparDL program at P = 8 they were about 40 % of the optimized instructions, and XLA:CPU's
compile time follows the instruction count (``docs/testing.md``, "Suite time"). The indices
here are non-negative and in bounds by construction, where truncating division and a plain
gather give the same numbers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ['rem', 'div', 'get', 'take_along']


def _log2(m) -> int | None:
  """``log2(m)`` for a static power of two, else None."""
  return m.bit_length() - 1 if isinstance(m, int) and m > 0 and m & (m - 1) == 0 else None


def rem(x: jax.Array, m) -> jax.Array:
  """``x % m`` for ``x >= 0`` and ``m > 0``: an ``and`` for a static power of two (XLA
  rewrites a signed remainder by ``2**j`` into six instructions), else HLO ``remainder``."""
  if _log2(m) is not None:
    return x & (m - 1)
  return jax.lax.rem(x, jnp.asarray(m, x.dtype))


def div(x: jax.Array, m) -> jax.Array:
  """``x // m`` for ``x >= 0`` and ``m > 0``: a shift for a static power of two, else HLO
  ``divide``."""
  if (bits := _log2(m)) is not None:
    return x >> bits
  return jax.lax.div(x, jnp.asarray(m, x.dtype))


def take_along(arr: jax.Array, indices: jax.Array, axis: int) -> jax.Array:
  """``jnp.take_along_axis`` for indices in ``[0, arr.shape[axis])``: one gather."""
  return jnp.take_along_axis(arr, indices, axis=axis, mode="promise_in_bounds",
                             wrap_negative_indices=False)


def get(arr: jax.Array, indices) -> jax.Array:
  """``arr[indices]`` for integer indices in bounds: one gather."""
  return arr.at[indices].get(mode="promise_in_bounds", wrap_negative_indices=False)
