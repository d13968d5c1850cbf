"""A delayed sync's pieces (``delay=1``): the message each step holds for the next, and what a
device can tell of the next delivery before it arrives.

Each step sends the message the step before left (:func:`held_message`) and leaves its own
(:func:`hold`): the gradient, flattened as the sync flattens one (the method's entries, then
the dense leaves'), in the :class:`~spardl_jax._src.sync.sync_state.Pending` of the state.
:func:`predicted_local` is each device's estimate of what the next step's sync will
deliver, from what it holds: the weight prediction's point
(:func:`spardl_jax.weight_prediction`) is taken there.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from spardl_jax._src.core import flat as flat_vector
from spardl_jax._src.core import protocol, topk
from spardl_jax._src.sync import registry
from spardl_jax._src.sync.plan import SyncPlan, on_device
from spardl_jax._src.sync.sync_state import Pending, SyncState

__all__ = ['UNORDERED_COLLECTIVES', 'waits_for_gradient', 'after', 'message_size', 'fresh_pending',
           'held_message', 'hold', 'predicted_local']

# Runtimes that may start a step's independent collectives in a different order on each
# device. XLA:CPU runs the thunks of a program that do not depend on each other at once, and
# each collective blocks its device until all have joined: with the sync independent of the
# step, three devices entered SparDL's first permute while five entered the loss's all-reduce
# and the step hung (a character GPT, 8 simulated devices, the AdamW recipe). There a delayed
# sync's message waits for this step's gradient (:func:`after`), so its collectives come
# in the undelayed order: the books are the same, the transfer is not hidden. GPUs and TPUs
# run every device's collectives in the one compiled order.
UNORDERED_COLLECTIVES = ("cpu",)


def waits_for_gradient() -> bool:
  """Whether a delayed sync's message must wait for this step's gradient here."""
  return jax.default_backend() in UNORDERED_COLLECTIVES


def after(message, floats):
  """``message`` itself, made to depend on every float leaf of this step's gradient: a select
  on a predicate that is always true (a count of finite entries is never negative) but that
  the compiler cannot prove, so it stays (an optimization barrier does not: XLA:CPU removes
  it before scheduling). One entry of each leaf, so the gradient's values cannot reach the
  message (a NaN is held, not sent early)."""
  finite = sum(jnp.isfinite(x.reshape(-1)[0]).astype(jnp.int32) for x in floats if x.size)
  return jnp.where(finite >= 0, message, jnp.zeros_like(message))


def message_size(plan: SyncPlan) -> int:
  """Entries of a delayed sync's held message: the method's ``n``, then the dense leaves'."""
  return plan.n + sum(math.prod(x.shape) for x in plan.kept)


def fresh_pending(plan: SyncPlan, lead: int) -> Pending:
  """No message held yet, on ``lead`` rows."""
  return Pending(jnp.zeros((lead, message_size(plan)), plan.dtype), jnp.zeros((lead,), bool))


def _unpack(plan: SyncPlan, message) -> tuple[jax.Array, list]:
  """A held ``(N,)`` message cut into the method's ``(n,)`` vector and the dense leaves; a
  clear error for a message of another size."""
  size = message_size(plan)
  if message.shape != (size,):
    raise ValueError(f"sync_gradients: the delayed sync's held message has "
                     f"{message.shape[0]} entries, but these gradients make {size}; init "
                     f"with this transformation and the same params.")
  return message[:plan.n], flat_vector.split(message[plan.n:], plan.kept)


def held_message(plan: SyncPlan, state: SyncState, floats: list) -> tuple[jax.Array, list]:
  """``(x, kept)`` this step sends: the message the last step held (zeros before the
  first), after this step's gradient (its float leaves ``floats``) where the runtime needs
  that order."""
  assert state.pending is not None  # SyncPlan.local checked the state has one
  message = on_device(state.pending.message)
  if waits_for_gradient():
    message = after(message, floats)
  return _unpack(plan, message)


def hold(plan: SyncPlan, synced: list, floats: list, state: SyncState, new_state: SyncState,
         next_message):
  """A delayed sync's last stage: ``(what this step delivers, the new state)``.

  Before any message was held (the first step) nothing is delivered and the sync's state
  stays as it was, so the delayed syncs are the undelayed ones one step later, state
  included. This step's message waits in :class:`Pending`: the gradient's float leaves
  ``floats`` themselves, or ``next_message(synced, gradient)`` leaf by leaf (what
  :func:`spardl_jax.adam.scale_by_synced_adam` sends is formed from this step's result)."""
  assert state.pending is not None
  held = on_device(state.pending.held)
  synced = [jnp.where(held, s, jnp.zeros_like(s)) for s in synced]
  new_state = jax.tree.map(lambda new, old: jnp.where(held, new, old), new_state, state)
  message = floats if next_message is None else [
      next_message(s, g).astype(g.dtype) for s, g in zip(synced, floats)]
  vec, kept = plan.vector(message, state.pending.message.dtype)
  if kept:
    vec = jnp.concatenate([vec, flat_vector.concat(kept, vec.dtype)])
  return synced, new_state._replace(pending=Pending(vec[None], jnp.ones((1,), bool)))


def predicted_local(plan: SyncPlan, state: SyncState, params):
  """This device's estimate of what its delayed sync delivers at the next update, as a tree
  like ``params`` (zeros for non-float leaves and before any message is held), on this
  device's shards.

  On the method's vector: the held message plus the method's residual where it keeps one,
  and for a sparse level the entries of the largest magnitudes only, as many as the level's
  density keeps (``max(1, round(density * n))``; ties kept; with ``balance`` ranked on the
  vector scaled leaf by leaf, as the sync scales it) — the level the count of syncs
  selects, as the sync will. The dense leaves (``dense_leaves``) are their held values. A
  non-sparse level (the dense warm-up, ``dense``, PowerSGD) keeps every entry. A message
  with a non-finite entry gives zeros (the sync will skip it).
  """
  pending = state.pending
  if pending is None:
    raise ValueError("predicted_params: the state holds no delayed message (delay=1).")
  vec, kept = _unpack(plan, on_device(pending.message))
  # The sync takes its scales from the message alone, before the residual joins it.
  scale = None if plan.options.balance is None else plan.balance_scales(vec)
  residual = protocol.residual(state.method_state)
  if residual is not None and residual.shape == (1, *vec.shape):
    vec = vec + on_device(residual).astype(vec.dtype)
  ranked = vec if scale is None else vec * scale

  def cut(level):
    if level.dense or not registry.is_sparse(level.allreduce.name) or level.density >= 1:
      return lambda v: v
    k = max(1, round(level.density * vec.size))

    def largest(v):
      keys = topk.keys(ranked)
      # In chunks: counting the whole vector once per key bit doubled a step of the
      # look-ahead's paced run (benchmarks/results/network.md, "Hiding the sync").
      return jnp.where(keys >= topk.kth_largest_in_chunks(keys[None], k)[0], v,
                       jnp.zeros_like(v))
    return largest

  if len(plan.levels) == 1:
    vec = cut(plan.levels[0])(vec)
  else:
    vec = jax.lax.switch(plan.level_index(on_device(state.count)),
                         [cut(level) for level in plan.levels], vec)
  # A non-finite message (a NaN gradient held, skipped when it is sent) is no estimate: the
  # point would be NaN and so would the next gradient, held in turn, for good. Each device
  # decides alone: no collective runs here.
  usable = on_device(pending.held) & jnp.all(jnp.isfinite(vec)) & jnp.all(jnp.asarray(
      [jnp.all(jnp.isfinite(k)) for k in kept] or [True]))
  estimate = [jnp.where(usable, e, jnp.zeros_like(e)) for e in plan.leaves(vec, kept)]
  return plan.tree(estimate, params, other=jnp.zeros_like)
