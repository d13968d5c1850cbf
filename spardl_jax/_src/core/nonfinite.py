"""What an all-reduce does when some device's input holds a NaN or an inf.

Every device must take the same decision in the same step: a device that skipped a
collective on its own would leave the others waiting in it (a hang, then an abort). The
decision is therefore made from a value every device holds bit-identically, and the raw
all-reduces (:func:`~spardl_jax.collectives.spardl_allreduce`,
:func:`~spardl_jax._src.sync.registry.sharded`) and the optax transformation share it:

* ``'skip'`` (the default everywhere): the result is zeros on every device and the state
  (residuals, controllers, thresholds) is returned unchanged, so one bad step poisons
  nothing and loses nothing;
* ``'propagate'``: the result and the new state are what the all-reduce computed, NaNs
  included (opt-in).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp

from spardl_jax._src.core.protocol import residual

__all__ = ['NonFinite', 'POLICIES', 'check_policy', 'any_device', 'skip_if']

NonFinite = Literal["skip", "propagate"]
POLICIES = ("skip", "propagate")


def check_policy(who: str, nonfinite) -> None:
  """Raises a ValueError naming ``who``'s ``nonfinite`` parameter and its allowed values."""
  if nonfinite not in POLICIES:
    raise ValueError(f"{who}: nonfinite must be one of {POLICIES}, got {nonfinite!r}.")


def any_device(reaches_result: bool, x: jax.Array, state: Any, y: jax.Array,
               axis_name) -> jax.Array:
  """() bool, True on every device when some device's ``x`` (or its residual) is not finite.

  Where the method guarantees that a non-finite input reaches its result (every selection
  ranks NaN and inf above any finite value, and ``y`` is bit-identical everywhere), the
  result itself tells: no extra communication. Otherwise one scalar ``pmax`` (4 bytes, one
  latency round) makes the devices agree.
  """
  if reaches_result:
    return ~jnp.all(jnp.isfinite(y))
  local_bad = ~jnp.all(jnp.isfinite(x))
  owed = residual(state)
  if owed is not None:
    local_bad |= ~jnp.all(jnp.isfinite(owed))
  return jax.lax.pmax(local_bad.astype(jnp.int32), axis_name) > 0


def skip_if(bad: jax.Array, y: jax.Array, new_state: Any, old_state: Any
            ) -> tuple[jax.Array, Any]:
  """``(zeros, old_state)`` where ``bad``, else ``(y, new_state)``: the ``'skip'`` policy.

  With a state to restore, a ``lax.cond`` chooses whole buffers: an elementwise select would
  read and write every entry of the result and of each state leaf again where XLA cannot
  fuse it into what made them (a scatter: a fifth of SparDL's sync on 8 simulated CPU
  devices at n = 14.7M). Without one (a dense all-reduce) a select on the result alone fuses
  into the elementwise ops that finish it, where the branch would copy it.
  """
  if not jax.tree.leaves(new_state):
    return jnp.where(bad, jnp.zeros_like(y), y), new_state

  def meet(chosen, other):
    # A leaf may be typed invariant over the mesh axis on one side and varying on the other
    # (a controller, PowerSGD's residual); a select on a constant predicate joins the two
    # types, and XLA folds it away.
    return jax.tree.map(lambda a, b: jnp.where(True, a, b), chosen, other)

  old, new = (jnp.zeros_like(y), old_state), (y, new_state)
  return jax.lax.cond(bad, lambda: meet(old, new), lambda: meet(new, old))
