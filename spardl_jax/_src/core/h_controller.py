"""The B-SAG compression-ratio (h) controller: the paper's Algorithm 2 as a pure function.

B-SAG sends each position's top-``h`` across the ``d`` teams. Too small an ``h`` leaves
fewer than ``kb`` distinct indices after the gather (bandwidth wasted on nothing), too large
an ``h`` sends entries that are cut again. The controller moves ``h`` like a congestion
window: it starts at ``kb / d`` with step ``0.01 kb (d - 1) / d``, doubles the step after two
moves in the right direction, and halves and reverses it when the count crosses ``kb``. ``h``
stays in ``[ceil(kb / d), kb]``.

Differences from the paper, forced by XLA (every device must send the same message shape):
``h`` is one value for all workers, driven by the mean distinct count over the ``Q`` positions
(each worker learns every position's count from the final all-gather, which carries it as
one extra word, so no extra round is needed); and the paper updates ``h`` before a sync
from the count of the previous one, so the first sync uses the initial ``h`` unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ['HState', 'empty', 'start', 'update']


class HState(NamedTuple):
  """Controller state, the same on every device.

  Attributes:
    h: () float32, the current (continuous) h; 0 before the first sync.
    step: () float32, the signed step added to h at each update.
    flag: () bool, one move in the right direction has been made.
    last_h: () int32, the message size the last sync used (a static ladder size).
    count: () float32, the mean distinct-index count the last B-SAG gathered (0 otherwise).
  """

  h: jax.Array
  step: jax.Array
  flag: jax.Array
  last_h: jax.Array
  count: jax.Array  # type: ignore[assignment]  # a field named count shadows tuple.count


def empty() -> HState:
  """The state before the first sync (sizes are only known at trace time)."""
  return HState(h=jnp.zeros((), jnp.float32), step=jnp.zeros((), jnp.float32),
                flag=jnp.zeros((), jnp.bool_), last_h=jnp.zeros((), jnp.int32),
                count=jnp.zeros((), jnp.float32))


def start(state: HState, *, kb: int, d: int) -> HState:
  """``state``, or Algorithm 2's initial values if no sync has run yet."""
  fresh = state.h == 0
  return HState(h=jnp.where(fresh, jnp.float32(kb / d), state.h),
                step=jnp.where(fresh, jnp.float32(0.01 * kb * (d - 1) / d), state.step),
                flag=jnp.where(fresh, False, state.flag), last_h=state.last_h,
                count=state.count)


def update(state: HState, count, *, kb: int, d: int) -> HState:
  """One step of Algorithm 2: the state for the next sync after one that gave ``count``.

  Args:
    state: the state the last sync used.
    count: () the number of distinct indices after the cross-team gather (float or int).
    kb: the target count ``L(k, d, P)`` per block.
    d: the number of teams.
  """
  right_way = (count > kb) != (state.step > 0)  # too many and shrinking, or too few and growing
  step = jnp.where(right_way, jnp.where(state.flag, state.step * 2, state.step),
                   -state.step / 2)
  flag = right_way & ~state.flag
  h = jnp.clip(state.h + step, float(-(-kb // d)), float(kb))
  return HState(h=h.astype(jnp.float32), step=step.astype(jnp.float32), flag=flag,
                last_h=state.last_h, count=jnp.asarray(count, jnp.float32))
