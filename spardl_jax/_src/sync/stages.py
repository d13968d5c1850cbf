"""The stages of one gradient sync, as :func:`spardl_jax.sync_gradients` runs them.

``update`` on one device (inside ``shard_map`` over every axis the sync needs bound), on the
trace's :class:`~spardl_jax._src.sync.plan.SyncPlan`:

1. the plan checks the state is this sync's, for these leaves (:meth:`SyncPlan.local`);
2. :func:`local_gradient`: DGC's momentum correction;
3. :func:`run_level`: the method of the current level (dense warm-up, a density of the
   schedule) all-reduces the flat vector, chosen by the step count with ``lax.switch``
   (after decaying the residual, where ``residual_decay`` asks); with ``balance``, on the
   vector and residual scaled leaf by leaf (:meth:`SyncPlan.balance_scales`) and scaled
   back (:func:`balanced_level`);
4. :func:`agree_on_nonfinite`: DGC's momentum factor masking, and the non-finite guard every
   device agrees on;
5. :func:`next_stats`: this sync's :class:`~spardl_jax.states.SyncStats`, every byte it sent
   counted here;
6. the synced vector cut back into the leaves (:meth:`SyncPlan.leaves`).

:mod:`spardl_jax._src.sync.entries` opens the ``shard_map`` that hands these stages local
shards; a delayed sync's pieces are :mod:`spardl_jax._src.sync.delay`'s.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spardl_jax._src.baselines.dense import formula as dense_formula
from spardl_jax._src.core import flat as flat_vector
from spardl_jax._src.core import nonfinite as nonfinite_policy
from spardl_jax._src.core import protocol
from spardl_jax._src.core.allreduce import bound_axes
from spardl_jax._src.sync import delay, levels
from spardl_jax._src.sync.packing import replica_axes
from spardl_jax._src.sync.plan import SyncPlan, as_rows, on_device
from spardl_jax._src.sync.sync_state import SyncState, SyncStats

__all__ = ['update_local', 'init_local', 'local_gradient', 'balanced_level', 'run_level',
           'agree_on_nonfinite', 'next_stats', 'dense_bytes', 'Local', 'LevelRun', 'Agreed']


class Local(NamedTuple):
  """What stage 2 (:func:`local_gradient`) hands on: ``x``, what the method all-reduces;
  ``dense``, the leaves kept dense; DGC's new ``velocity`` (None without momentum
  correction)."""

  x: jax.Array
  dense: list
  velocity: Any


class LevelRun(NamedTuple):
  """What stage 3 (:func:`run_level`) hands on: the method's result ``y``, its new local
  state, the bytes it sent and SAG's ``h`` (typed alike for every level, so that
  ``lax.switch`` can choose among them), the level that ran, and the local state as that
  level saw it (restarted on entering a sparse level): what a skipped step keeps."""

  y: jax.Array
  state: Any
  bytes_sent: jax.Array
  h: jax.Array
  level: jax.Array
  before: Any


class Agreed(NamedTuple):
  """What stage 4 (:func:`agree_on_nonfinite`) hands on: the level's run (zeroed and its
  state restored where the step is skipped), the dense leaves' one mean (None without
  them), the velocity after masking, and ``bad``, whether any device saw a non-finite
  value."""

  run: LevelRun
  mean: jax.Array | None
  velocity: Any
  bad: jax.Array


def local_gradient(plan: SyncPlan, flat, dense: list, old_velocity) -> Local:
  """Stage 2: DGC's momentum correction (the velocity is what travels)."""
  options = plan.options
  if options.momentum is None:
    return Local(flat, dense, None)
  velocity = (options.momentum * old_velocity + flat).astype(flat.dtype)
  return Local(velocity, dense, velocity)


def _run_one(plan: SyncPlan, level: levels.Level, x, local, index) -> LevelRun:
  """One level's sync. ``residual_decay`` scales the residual first (SparseLoCo's
  ``e <- beta e + delta``); the state a skipped step restores is the one before it."""
  axis_name, decay = plan.options.axis_name, plan.options.residual_decay
  itemsize = np.dtype(plan.dtype).itemsize
  before = local
  owed = protocol.residual(local)
  if decay is not None and owed is not None:  # init refused a decay without a residual
    owed = jnp.asarray(decay * owed, owed.dtype)
    local = local._replace(residual=owed)
  if level.dense:  # deliver the residual's mass too, and empty it
    y, _ = level.allreduce.apply(x if owed is None else x + owed, (), axis_name=axis_name)
    if owed is not None:
      local = local._replace(residual=jnp.zeros_like(owed))
    bytes_sent, h = level.allreduce.stats(n=plan.n, p=plan.p, itemsize=itemsize, state=(),
                                          rank=None)
  else:
    y, local = level.allreduce.apply(x, local, axis_name=axis_name)
    bytes_sent, h = level.allreduce.stats(n=plan.n, p=plan.p, itemsize=itemsize, state=local,
                                          rank=jax.lax.axis_index(axis_name))
  return LevelRun(y, local, jnp.asarray(bytes_sent, jnp.float32), jnp.asarray(h, jnp.int32),
                  index, before)


def _scaled_residual(local, times):
  owed = protocol.residual(local)
  return local if owed is None else local._replace(residual=times(owed).astype(owed.dtype))


def balanced_level(plan: SyncPlan, x, local, count) -> LevelRun:
  """Stage 3 with ``balance``: the level runs on ``x`` and the residual scaled leaf by leaf
  (:meth:`SyncPlan.balance_scales`), and its result, residual and the state a skipped step keeps are
  scaled back, so everything outside the method stays in the gradient's units."""
  if plan.options.balance is None:
    return run_level(plan, x, local, count)
  scale = plan.balance_scales(x)
  run = run_level(plan, x * scale, _scaled_residual(local, lambda e: e * scale), count)
  back = functools.partial(_scaled_residual, times=lambda e: e / scale)
  return run._replace(y=(run.y / scale).astype(run.y.dtype), state=back(run.state),
                      before=back(run.before))


def run_level(plan: SyncPlan, x, local, count) -> LevelRun:
  """Stage 3: the level of sync ``count`` runs (``lax.switch`` among compiled levels)."""
  if len(plan.levels) == 1:
    return _run_one(plan, plan.levels[0], x, local, jnp.zeros((), jnp.int32))
  starts = plan.level_starts()
  index = plan.level_index(count)
  # Entering a sparse level restarts the method's other state for its size; the residual
  # (delivered or still owed mass) carries over.
  entering = jnp.isin(count, starts[1:])
  fresh = plan.fresh()
  owed = protocol.residual(local)
  if owed is not None:
    fresh = fresh._replace(residual=owed)
  local = jax.tree.map(lambda a, b: jnp.where(entering, a, b), fresh, local)
  branches = [functools.partial(_run_one, plan, level) for level in plan.levels]
  return jax.lax.switch(index, [lambda op, f=f: f(*op) for f in branches], (x, local, index))


def agree_on_nonfinite(plan: SyncPlan, local: Local, run: LevelRun, mean, old_velocity
                       ) -> Agreed:
  """Stage 4: DGC's momentum factor masking, then the non-finite guard every device
  agrees on (the dense leaves' ``mean`` included); ``old_velocity`` is what a skipped step
  keeps."""
  options = plan.options
  velocity = local.velocity
  y, new_local = run.y, run.state
  bad = nonfinite_policy.any_device(options.reaches_result, local.x, run.before, y,
                                    options.axis_name)
  if mean is not None:  # the same on every device
    bad |= ~jnp.all(jnp.isfinite(mean))
  others = tuple(a for a in bound_axes() if a != options.axis_name and a not in replica_axes())
  if others:  # every column skips, or none: a step is never applied to some shards only
    bad = jax.lax.pmax(bad.astype(jnp.int32), others) > 0
  if velocity is not None and options.momentum_masking:
    sparse = ~jnp.asarray([level.dense for level in plan.levels])[run.level]
    velocity = jnp.where(sparse & (y != 0), jnp.zeros_like(velocity), velocity)
  if options.nonfinite == "skip":
    y, new_local = nonfinite_policy.skip_if(bad, y, new_local, run.before)
    if mean is not None:
      mean = jnp.where(bad, jnp.zeros_like(mean), mean)
    if velocity is not None:
      velocity = jnp.where(bad, old_velocity, velocity)
  return Agreed(run._replace(y=y, state=new_local), mean, velocity, bad)


def dense_bytes(p: int, n: int, itemsize: int) -> int:
  """Bytes one device sends in the ring all-reduce (``pmean``) of ``n`` dense entries."""
  return dense_formula(p, n, itemsize).bytes


def next_stats(plan: SyncPlan, agreed: Agreed, old: SyncStats, extra_bytes=0) -> SyncStats:
  """Stage 5: this sync's :class:`SyncStats`, from what every device already holds. Every
  byte the sync sent is counted here: the level's, the dense leaves' one ``pmean`` (as the
  dense method counts its own; their entries count among those delivered), ``balance``'s
  all-reduce, and ``extra_bytes`` a transformation around the sync sent for it (Adam's
  dense refresh of its second moment)."""
  run = agreed.run
  residual = protocol.residual(run.state)
  density = jnp.asarray([level.density for level in plan.levels], jnp.float32)[run.level]
  itemsize = np.dtype(plan.dtype).itemsize
  sent = run.bytes_sent + extra_bytes
  if agreed.mean is not None:
    sent = sent + dense_bytes(plan.p, agreed.mean.size, itemsize)
  if plan.options.balance is not None:  # float32 sums
    sent = sent + dense_bytes(plan.p, 2 * len(plan.sizes), np.dtype(np.float32).itemsize)
  selected = jnp.count_nonzero(run.y).astype(jnp.int32)
  if agreed.mean is not None:
    selected = selected + jnp.count_nonzero(agreed.mean).astype(jnp.int32)
  return SyncStats(
      selected=selected[None], bytes_sent=jnp.asarray(sent, jnp.float32)[None], h=run.h[None],
      residual_norm=(jnp.zeros((1,), jnp.float32) if residual is None else
                     jnp.linalg.norm(residual.astype(jnp.float32))[None]),
      nonfinite=old.nonfinite + agreed.bad.astype(jnp.int32),
      density=density[None])


def update_local(plan: SyncPlan, updates, state, next_message=None, extra_bytes=0):
  """Every stage on this device's local gradients: ``(the synced gradients, new state)``.
  With ``delay`` the stages run on the message the last step left, and this step's
  gradient (or ``next_message`` of it) is left for the next (:func:`delay.hold`)."""
  options = plan.options
  floats = plan.float_leaves(updates)  # once: the stages see this device's float leaves
  local = plan.local(state)
  _refuse_misplaced(state)
  velocity = None if state.velocity is None else on_device(state.velocity)
  if options.delay:
    x, kept = delay.held_message(plan, state, floats)
  else:
    x, kept = plan.vector(floats)
  prepared = local_gradient(plan, x, kept, velocity)
  count = on_device(state.count)
  run = balanced_level(plan, prepared.x, local, count)
  # The dense leaves: one pmean of their concatenation (one all-reduce).
  mean = (jax.lax.pmean(flat_vector.concat(prepared.dense, plan.dtype), options.data_axes)
          if prepared.dense else None)
  agreed = agree_on_nonfinite(plan, prepared, run, mean, velocity)
  new_state = SyncState(as_rows(agreed.run.state),
                        None if agreed.velocity is None else as_rows(agreed.velocity),
                        state.count + 1, next_stats(plan, agreed, state.stats, extra_bytes),
                        state.built_for, state.pending, state.placed)
  kept_means = [] if agreed.mean is None else flat_vector.split(agreed.mean, plan.kept)
  synced = plan.leaves(agreed.run.y, kept_means)
  if options.delay:
    synced, new_state = delay.hold(plan, synced, floats, state, new_state, next_message)
  elif next_message is not None:
    raise ValueError("sync_gradients: update got next_message, which only a delayed sync "
                     "takes (delay=1).")
  return plan.tree(synced, updates), new_state


def init_local(plan: SyncPlan, lead: int) -> SyncState:
  """The state on this device (``lead`` 1), or outside ``shard_map`` every device's rows at
  once (``lead`` P)."""
  options = plan.options

  def rows(a):
    a = jnp.asarray(a)
    return jnp.broadcast_to(a[None], (lead, *a.shape))

  fresh = plan.fresh()
  if options.residual_decay is not None and protocol.residual(fresh) is None:
    raise ValueError(f"sync_gradients: residual_decay={options.residual_decay} decays the "
                     f"error feedback, but {options.method!r} keeps none; use a method with "
                     f"a residual (spardl, topka, sparseloco, powersgd, ...) or drop "
                     f"residual_decay.")
  if options.balance is not None and protocol.residual(fresh) is None:
    raise ValueError(f"sync_gradients: balance={options.balance!r} scales the leaves a "
                     f"sparse method selects among, but {options.method!r} keeps no "
                     f"residual (it selects nothing or loses what it leaves); use a method "
                     f"with a residual (spardl, topka, sparseloco, ...) or drop balance.")
  velocity = None if options.momentum is None else jnp.zeros((lead, plan.n), plan.dtype)
  pending = delay.fresh_pending(plan, lead) if options.delay else None
  return SyncState(jax.tree.map(rows, fresh), velocity, jnp.zeros((lead,), jnp.int32),
                   SyncStats.zeros(lead), plan.built_for, pending,
                   jnp.full((lead,), _devices_here(lead), jnp.int32))


def _devices_here(lead: int = 1) -> int:
  """The devices of the mesh the sync runs on: inside ``shard_map`` every axis of it is
  bound; outside, the ``lead`` rows ``init`` builds at once."""
  mesh = jax.sharding.get_abstract_mesh()
  bound = bound_axes()
  return math.prod(mesh.shape[a] for a in mesh.axis_names) if bound else lead


def _refuse_misplaced(state: SyncState) -> None:
  """A state whose rows were laid out for another device count (cut, padded or copied by a
  restore that did not refold them) is refused at its first update, on every device alike
  (every row of one saved state holds the same count), before any collective."""
  if state.placed is None:
    return
  devices = _devices_here()
  was = on_device(state.placed)

  def refuse(was):
    raise ValueError(
        f"sync_gradients: the state's rows were laid out for {int(was)} devices and this step "
        f"runs on {devices}: a restore cut, padded or copied them (Orbax's strict=False does; "
        f"it drops the residuals' mass). Restore the state as saved "
        f"(sj.checkpoint.as_saved) and fold it onto these devices with "
        f"sj.checkpoint.refold.")

  jax.lax.cond(was != devices, lambda: jax.debug.callback(refuse, was), lambda: None)
