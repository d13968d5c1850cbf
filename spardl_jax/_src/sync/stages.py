"""The stages of one gradient sync, as :func:`spardl_jax.sync_gradients` runs them.

``update`` on one device (inside ``shard_map`` over every axis the sync needs bound):

1. :func:`check_state`: the state is this sync's, for gradients of these leaves;
2. :func:`local_gradient`: DGC's local clipping and momentum correction;
3. :func:`run_level`: the method of the current level (dense warm-up, a density of the
   schedule) all-reduces the flat vector, chosen by the step count with ``lax.switch``
   (after decaying the residual, where ``residual_decay`` asks); with ``balance``, on the
   vector and residual scaled leaf by leaf and scaled back (:func:`balanced_level`);
4. :func:`agree_on_nonfinite`: DGC's momentum factor masking, and the non-finite guard every
   device agrees on;
5. :func:`next_stats`: this sync's :class:`~spardl_jax.SyncStats`;
6. the synced vector cut back into the leaves (:meth:`FlatLayout.unflatten`).

:mod:`spardl_jax._src.sync.entries` opens the ``shard_map`` that hands these stages local shards,
after :mod:`spardl_jax._src.sync.guards`' refusals. Every function takes the validated
:class:`SyncOptions` explicitly.
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
from spardl_jax._src.core.allreduce import axis_size, bound_axes
from spardl_jax._src.sync import levels
from spardl_jax._src.sync.flat_layout import (NO_SPECS, FlatLayout, LeafSpecs, Leaves, method_leaves,
                                         merge_float_leaves, split_leaves, with_float_leaves)
from spardl_jax._src.sync.sync_state import LeafShapes, Pending, SyncState, SyncStats
from spardl_jax._src.sync.settings import SyncOptions

__all__ = ['init_local', 'update_local', 'check_state',
           'local_gradient', 'leaf_scales', 'balanced_level', 'run_level',
           'agree_on_nonfinite', 'next_stats',
           'level_starts', 'level_index', 'UNORDERED_COLLECTIVES',
           'waits_for_gradient', 'message_size', 'unpack', 'hold', 'Local', 'LevelRun',
           'Agreed']


class Trace(NamedTuple):
  """What an update's gradients fix at trace time: their float leaves' shapes, the flat
  layout, the promoted dtype, the levels bound to those leaves, the devices ``p`` on
  the data axis, and the ``sizes`` of the leaves the method syncs."""

  leaves: LeafShapes
  layout: FlatLayout
  dtype: Any
  levels: tuple[levels.Level, ...]
  p: int
  sizes: tuple[int, ...]


class Local(NamedTuple):
  """What stage 2 (:func:`local_gradient`) hands on: ``x``, what the method all-reduces;
  ``dense``, the leaves kept dense, and ``means``, their one ``pmean`` once taken; DGC's new
  ``velocity`` (None without momentum correction)."""

  x: jax.Array
  dense: list
  velocity: Any
  means: tuple = ()


class LevelIn(NamedTuple):
  """What each level's branch of stage 3 takes (``lax.switch``'s one operand): the vector
  ``x``, the method's ``local`` state, and the index of the ``level``."""

  x: jax.Array
  local: Any
  level: jax.Array


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
  state restored where the step is skipped), the dense leaves' means, the velocity after
  masking, and ``bad``, whether any device saw a non-finite value."""

  run: LevelRun
  means: list
  velocity: Any
  bad: jax.Array


def _shapes(floats) -> LeafShapes:
  return LeafShapes(tuple(tuple(int(d) for d in x.shape) for x in floats))


def _devices(options: SyncOptions) -> tuple[int, int]:
  """``(lead, p)``: the leading device axis of the state ``init`` creates here, and the
  number of devices on the data axis."""
  try:
    return 1, jax.lax.axis_size(options.axis_name)  # Inside shard_map: this device's slice.
  except NameError:  # the axis is not bound here: outside shard_map
    pass
  if options.axis_size is not None:
    return options.axis_size, options.axis_size
  bound = bound_axes()
  if bound:
    raise ValueError(
        f"sync_gradients: axis_name={options.axis_name!r}, but init runs inside "
        f"jax.shard_map over the axes {bound}; pass the data-parallel axis of that mesh as "
        f"axis_name (the same to the transformation and to init_opt_state).")
  mesh = jax.sharding.get_abstract_mesh()
  if options.axis_name in mesh.axis_names:
    return mesh.shape[options.axis_name], mesh.shape[options.axis_name]
  raise ValueError(
      f"sync_gradients: init was called outside shard_map, so the number of devices on axis "
      f"{options.axis_name!r} is unknown. Use spardl_jax.init_opt_state(tx, params, mesh), "
      f"call init inside jax.shard_map, run under jax.set_mesh(mesh), or pass axis_size=P.")


def fresh_state(options: SyncOptions, bound, n: int, dtype, p: int):
  """The method's per-device state for ``n`` entries. The last level's all-reduce owns it;
  every sparse level's must share its structure (checked on shapes, nothing allocated)."""
  structures = {jax.tree.structure(jax.eval_shape(
      functools.partial(level.allreduce.init, n=n, dtype=dtype, p=p)))
                for level in bound if not level.dense}
  if len(structures) > 1:
    raise ValueError(f"sync_gradients: the density levels of {options.method!r} keep states "
                     f"of different structures; use one density.")
  return bound[-1].allreduce.init(n=n, dtype=dtype, p=p)


def init_local(options: SyncOptions, params, where: LeafSpecs = NO_SPECS) -> SyncState:
  """The state on this device (or, outside ``shard_map``, every device's rows at once)."""
  lead, p = _devices(options)  # first: the layout needs the axes it names
  split = split_leaves(options, params, where)
  dtype, n = split.dtype, split.layout.n
  bound = levels.bind(list(options.levels), [x.shape for x in split.method], p)

  def rows(a):
    a = jnp.asarray(a)
    return jnp.broadcast_to(a[None], (lead, *a.shape))

  velocity = None if options.momentum is None else jnp.zeros((lead, n), dtype)
  fresh = fresh_state(options, bound, n, dtype, p)
  pending = None
  if options.delay:
    size = message_size(n, split.kept)
    pending = Pending(jnp.zeros((lead, size), dtype), jnp.zeros((lead,), bool))
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
  return SyncState(jax.tree.map(rows, fresh), velocity,
                   jnp.zeros((lead,), jnp.int32), SyncStats.zeros(lead), _shapes(split.floats),
                   pending)


def check_state(options: SyncOptions, state, trace: Trace):
  """Stage 1: ``state`` is this sync's, as one device sees it inside ``shard_map``, for
  the gradients of ``trace``; returns the method's per-device state."""
  if not isinstance(state, SyncState):
    raise TypeError(f"sync_gradients: state must be the SyncState from init, got "
                    f"{type(state).__name__}.")
  for leaf in jax.tree.leaves(state):
    if leaf.shape[:1] != (1,):
      raise ValueError(
          f"sync_gradients: update must run inside jax.shard_map over {options.axis_name!r} "
          f"with the state sharded PartitionSpec({options.axis_name!r}) (each device sees a "
          f"leading axis of 1), got a state leaf of shape {leaf.shape}; see "
          f"spardl_jax.opt_state_specs.")
  if (state.velocity is None) != (options.momentum is None):
    raise ValueError("sync_gradients: the state was initialized with another momentum "
                     "setting; init with this transformation.")
  if (state.pending is None) != (options.delay == 0):
    raise ValueError(f"sync_gradients: the state was initialized with another delay (this "
                     f"sync has delay={options.delay}); init with this transformation.")
  if state.leaves != trace.leaves:
    raise ValueError(f"sync_gradients: the gradients' float leaves have the shapes "
                     f"{trace.leaves.shapes}, but the state was built for "
                     f"{state.leaves.shapes}; init with the same params (and param_specs).")
  local = jax.tree.map(lambda a: a[0], state.method_state)
  expected = jax.eval_shape(lambda: fresh_state(options, trace.levels, trace.layout.n,
                                                trace.dtype, trace.p))
  # jaxlib ships PyTreeDef.__eq__ but no stub for it: the checker cannot see it.
  same = jax.tree.structure(local) == jax.tree.structure(expected)  # type: ignore[operator]
  if not same or any(
      a.shape != b.shape for a, b in zip(jax.tree.leaves(local), jax.tree.leaves(expected))):
    raise ValueError(
        f"sync_gradients: the state does not fit {options.method!r} for {trace.layout.n} "
        f"float entries (it holds {type(local).__name__} with shapes "
        f"{[a.shape for a in jax.tree.leaves(local)]}); init it with this transformation "
        f"and the same params.")
  return local


def local_gradient(options: SyncOptions, flat, dense: list, old_velocity, p: int) -> Local:
  """Stage 2: DGC's local clipping (of the flat vector and the ``dense`` leaves together),
  then its momentum correction (the velocity is what travels)."""
  if options.clip_norm is not None:
    norm = jnp.sqrt(sum((jnp.sum(jnp.square(v.astype(jnp.float32))) for v in [flat, *dense]),
                        jnp.zeros((), jnp.float32)))
    limit = options.clip_norm / np.sqrt(p)
    scale = jnp.minimum(1.0, limit / jnp.maximum(norm, 1e-30))
    flat = (flat * scale).astype(flat.dtype)
    dense = [(v * scale).astype(v.dtype) for v in dense]
  if options.momentum is None:
    return Local(flat, dense, None)
  velocity = (options.momentum * old_velocity[0] + flat).astype(flat.dtype)
  return Local(velocity, dense, velocity)


def _run_one(options: SyncOptions, trace: Trace, level: levels.Level, given: LevelIn
             ) -> LevelRun:
  """One level's sync. ``residual_decay`` scales the residual first (SparseLoCo's
  ``e <- beta e + delta``); the state a skipped step restores is the one before it."""
  x, local, index = given
  axis_name, decay = options.axis_name, options.residual_decay
  n, p, itemsize = trace.layout.n, trace.p, np.dtype(trace.dtype).itemsize
  before = local
  owed = protocol.residual(local)
  if decay is not None and owed is not None:  # init refused a decay without a residual
    owed = jnp.asarray(decay * owed, owed.dtype)
    local = local._replace(residual=owed)
  if level.dense:  # deliver the residual's mass too, and empty it
    y, _ = level.allreduce.apply(x if owed is None else x + owed, (), axis_name=axis_name)
    if owed is not None:
      local = local._replace(residual=jnp.zeros_like(owed))
    bytes_sent, h = level.allreduce.stats(n=n, p=p, itemsize=itemsize, state=(), rank=None)
  else:
    y, local = level.allreduce.apply(x, local, axis_name=axis_name)
    bytes_sent, h = level.allreduce.stats(n=n, p=p, itemsize=itemsize, state=local,
                                          rank=jax.lax.axis_index(axis_name))
  return LevelRun(y, local, jnp.asarray(bytes_sent, jnp.float32), jnp.asarray(h, jnp.int32),
                  index, before)


def leaf_scales(options: SyncOptions, layout: FlatLayout, x, sizes) -> jax.Array:
  """Stage 2b (``balance="leaves"``): the power of two each entry of ``x`` is scaled by
  before the method selects, the same for a whole leaf (of the ``sizes``, as ``layout``
  flattens them) and on every device of the data axes: the one nearest to the ratio of
  the vector's root mean square to the leaf's, both over the devices' ``x`` (one all-reduce
  of two numbers a leaf). Under Adam every coordinate moves by about the learning rate
  whatever its gradient's size, and a leaf whose gradients are a tenth of the others' is
  starved by one top-k over the whole vector; scaled, each leaf competes at the same size.
  A power of two, so that scaling and unscaling are exact and the books stay exact; a leaf
  of zeros or non-finite values is not scaled (the guard skips the latter's step)."""
  ids = layout.leaf_ids(sizes)
  count = len(sizes)
  squares = jax.ops.segment_sum(jnp.square(x.astype(jnp.float32)), ids, count + 1)
  entries = jax.ops.segment_sum(jnp.ones(x.shape, jnp.float32), ids, count + 1)
  totals = jax.lax.psum(jnp.stack([squares[:count], entries[:count]]), options.data_axes)
  overall = jnp.sum(totals[0]) / jnp.sum(totals[1])
  ratio = 0.5 * jnp.log2(overall / (totals[0] / jnp.maximum(totals[1], 1.0)))
  limit = jnp.finfo(x.dtype).maxexp // 4  # room left for a residual larger than its leaf
  exponent = jnp.where(jnp.isfinite(ratio), jnp.clip(jnp.round(ratio), -limit, limit), 0.0)
  exponent = jnp.append(exponent.astype(jnp.int32), 0)  # the padding's
  # 2**e built from its bits: exact, where exp2 may round.
  scale = jax.lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32).astype(x.dtype)
  return scale[ids]


def balance_entries(sizes) -> int:
  """Entries of :func:`leaf_scales`' all-reduce: two per leaf."""
  return 2 * len(sizes)


def _scaled_residual(local, times):
  owed = protocol.residual(local)
  return local if owed is None else local._replace(residual=times(owed).astype(owed.dtype))


def balanced_level(options: SyncOptions, trace: Trace, prepared: Local, local, count
                   ) -> LevelRun:
  """Stage 3 with ``balance``: the level runs on ``x`` and the residual scaled leaf by leaf
  (:func:`leaf_scales`), and its result, residual and the state a skipped step keeps are
  scaled back, so everything outside the method stays in the gradient's units."""
  if options.balance is None:
    return run_level(options, trace, prepared.x, local, count)
  scale = leaf_scales(options, trace.layout, prepared.x, trace.sizes)
  run = run_level(options, trace, prepared.x * scale,
                  _scaled_residual(local, lambda e: e * scale), count)
  back = functools.partial(_scaled_residual, times=lambda e: e / scale)
  return run._replace(y=(run.y / scale).astype(run.y.dtype), state=back(run.state),
                      before=back(run.before))


def level_starts(levels_) -> np.ndarray:
  """The step each level (of the sequence ``levels_``) starts at, ascending."""
  return np.array([level.start for level in levels_])


def level_index(starts: np.ndarray, count) -> jax.Array:
  """The index of the level (of :func:`level_starts`' ``starts``) that sync ``count``
  runs."""
  return (jnp.sum(count >= starts) - 1).astype(jnp.int32)


def run_level(options: SyncOptions, trace: Trace, x, local, count) -> LevelRun:
  """Stage 3: the level of sync ``count`` runs (``lax.switch`` among compiled levels)."""
  run = functools.partial(_run_one, options, trace)
  if len(trace.levels) == 1:
    return run(trace.levels[0], LevelIn(x, local, jnp.zeros((), jnp.int32)))
  starts = level_starts(trace.levels)
  index = level_index(starts, count)
  # Entering a sparse level restarts the method's other state for its size; the residual
  # (delivered or still owed mass) carries over.
  entering = jnp.isin(count, starts[1:])
  fresh = fresh_state(options, trace.levels, trace.layout.n, trace.dtype, trace.p)
  owed = protocol.residual(local)
  if owed is not None:
    fresh = fresh._replace(residual=owed)
  local = jax.tree.map(lambda a, b: jnp.where(entering, a, b), fresh, local)
  return jax.lax.switch(index, [functools.partial(run, level) for level in trace.levels],
                        LevelIn(x, local, index))


def agree_on_nonfinite(options: SyncOptions, trace: Trace, local: Local, run: LevelRun,
                       old_velocity) -> Agreed:
  """Stage 4: DGC's momentum factor masking, then the non-finite guard every device
  agrees on (the dense leaves' means included); ``old_velocity`` is what a skipped step
  keeps."""
  x, velocity, means = local.x, local.velocity, list(local.means)
  y, new_local = run.y, run.state
  bad = nonfinite_policy.any_device(options.reaches_result, x, run.before, y,
                                    options.axis_name)
  for mean in means:  # the dense leaves' means, the same on every device
    bad |= ~jnp.all(jnp.isfinite(mean))
  others = tuple(a for a in bound_axes() if a != options.axis_name)
  if others:  # every column skips, or none: a step is never applied to some shards only
    bad = jax.lax.pmax(bad.astype(jnp.int32), others) > 0
  if velocity is not None and options.momentum_masking:
    sparse = ~jnp.asarray([level.dense for level in trace.levels])[run.level]
    velocity = jnp.where(sparse & (y != 0), jnp.zeros_like(velocity), velocity)
  if options.nonfinite == "skip":
    y, new_local = nonfinite_policy.skip_if(bad, y, new_local, run.before)
    means = [jnp.where(bad, jnp.zeros_like(mean), mean) for mean in means]
    if velocity is not None:
      velocity = jnp.where(bad, old_velocity[0], velocity)
  return Agreed(run._replace(y=y, state=new_local), means, velocity, bad)


def dense_bytes(p: int, n: int, itemsize: int) -> int:
  """Bytes one device sends in the ring all-reduce (``pmean``) of ``n`` dense entries."""
  return dense_formula(p, n, itemsize).bytes


def next_stats(trace: Trace, agreed: Agreed, old: SyncStats) -> SyncStats:
  """Stage 5: this sync's :class:`SyncStats`, from what every device already holds. The
  dense leaves' entries count among those delivered, and their one ``pmean`` among the
  bytes (as the dense method counts its own)."""
  run = agreed.run
  residual = protocol.residual(run.state)
  density = jnp.asarray([level.density for level in trace.levels], jnp.float32)[run.level]
  itemsize = np.dtype(trace.dtype).itemsize
  return SyncStats(
      selected=(jnp.count_nonzero(run.y).astype(jnp.int32)
                + sum(jnp.count_nonzero(m) for m in agreed.means))[None],
      bytes_sent=(run.bytes_sent
                  + sum(dense_bytes(trace.p, m.size, itemsize) for m in agreed.means))[None],
      h=run.h[None],
      residual_norm=(jnp.zeros((1,), jnp.float32) if residual is None else
                     jnp.linalg.norm(residual.astype(jnp.float32))[None]),
      nonfinite=old.nonfinite + agreed.bad.astype(jnp.int32),
      density=density[None])


def update_local(options: SyncOptions, updates, state, where: LeafSpecs = NO_SPECS,
                 next_message=None):
  """Every stage on this device's local gradients: ``(the synced gradients, new state)``.
  With ``delay`` the stages run on the message the last step left, and this step's
  gradient (or ``next_message`` of it) is left for the next (:func:`hold`)."""
  p = axis_size(options.axis_name, who="sync_gradients: update")
  leaves, treedef = jax.tree.flatten(updates)
  split = split_leaves(options, updates, where)
  layout, kept = split.layout, split.kept
  trace = Trace(_shapes(split.floats), layout, split.dtype,
                tuple(levels.bind(list(options.levels), [x.shape for x in split.method], p)),
                p, tuple(x.size for x in split.method))
  local = check_state(options, state, trace)
  if options.delay:
    message = state.pending.message[0]
    if waits_for_gradient():
      message = _after(message, split.floats)
    x, kept = unpack(message, layout.n, kept)
  else:
    x = layout.flatten(split.method, split.dtype)
  prepared = local_gradient(options, x, kept, state.velocity, trace.p)
  run = balanced_level(options, trace, prepared, local, state.count[0])
  if prepared.dense:  # the dense leaves: one pmean of their concatenation (one all-reduce)
    prepared = prepared._replace(means=(jax.lax.pmean(
        flat_vector.concat(prepared.dense, split.dtype), options.data_axes),))
  agreed = agree_on_nonfinite(options, trace, prepared, run, state.velocity)
  stats = next_stats(trace, agreed, state.stats)
  if options.balance is not None:  # leaf_scales' all-reduce
    stats = stats._replace(bytes_sent=stats.bytes_sent + dense_bytes(
        trace.p, balance_entries(trace.sizes), np.dtype(np.float32).itemsize))
  new_state = SyncState(jax.tree.map(lambda a: a[None], agreed.run.state),
                        None if agreed.velocity is None else agreed.velocity[None],
                        state.count + 1, stats, state.leaves, state.pending)
  synced = merge_float_leaves(split.dense, layout.unflatten(agreed.run.y, split.method),
                              flat_vector.split(agreed.means[0], kept) if agreed.means else [])
  if options.delay:
    synced, new_state = hold(split, synced, state, new_state, next_message)
  elif next_message is not None:
    raise ValueError("sync_gradients: update got next_message, which only a delayed sync "
                     "takes (delay=1).")
  return with_float_leaves(treedef, leaves, synced), new_state


# Runtimes that may start a step's independent collectives in a different order on each
# device. XLA:CPU runs the thunks of a program that do not depend on each other at once, and
# each collective blocks its device until all have joined: with the sync independent of the
# step, three devices entered SparDL's first permute while five entered the loss's all-reduce
# and the step hung (a character GPT, 8 simulated devices, the AdamW recipe). There a delayed
# sync's message waits for this step's gradient (:func:`_after`), so its collectives come
# in the undelayed order: the books are the same, the transfer is not hidden. GPUs and TPUs
# run every device's collectives in the one compiled order.
UNORDERED_COLLECTIVES = ("cpu",)


def waits_for_gradient() -> bool:
  """Whether a delayed sync's message must wait for this step's gradient here."""
  return jax.default_backend() in UNORDERED_COLLECTIVES


def _after(message, floats):
  """``message`` itself, made to depend on every float leaf of this step's gradient: a select
  on a predicate that is always true (a count of finite entries is never negative) but that
  the compiler cannot prove, so it stays (an optimization barrier does not: XLA:CPU removes
  it before scheduling). One entry of each leaf, so the gradient's values cannot reach the
  message (a NaN is held, not sent early)."""
  finite = sum(jnp.isfinite(x.reshape(-1)[0]).astype(jnp.int32) for x in floats if x.size)
  return jnp.where(finite >= 0, message, jnp.zeros_like(message))


def message_size(n: int, kept) -> int:
  """Entries of a delayed sync's held message: the method's ``n``, then the dense leaves
  ``kept`` (arrays or shapes' holders)."""
  return n + sum(math.prod(x.shape) for x in kept)


def unpack(message, n: int, kept: list):
  """A delayed sync's held ``message`` cut into the method's ``(n,)`` vector and the dense
  leaves (shaped like ``kept``); a clear error for a message of another size."""
  size = message_size(n, kept)
  if message.shape != (size,):
    raise ValueError(f"sync_gradients: the delayed sync's held message has "
                     f"{message.shape[0]} entries, but these gradients make {size}; init "
                     f"with this transformation and the same params.")
  return message[:n], flat_vector.split(message[n:], kept)


def hold(split: Leaves, synced, state, new_state, next_message):
  """A delayed sync's last stage: ``(what this step delivers, the new state)``.

  Before any message was held (the first step) nothing is delivered and the sync's state
  stays as it was, so the delayed syncs are the undelayed ones one step later, state
  included. This step's message, flattened as the sync flattens a gradient, waits in
  :class:`Pending`: the gradient itself, or ``next_message(synced, gradient)`` leaf by leaf
  (what :func:`spardl_jax.adam.scale_by_synced_adam` sends is formed from this step's result)."""
  floats, dense = split.floats, split.dense
  held = state.pending.held[0]
  synced = [jnp.where(held, s, jnp.zeros_like(s)) for s in synced]
  new_state = jax.tree.map(lambda new, old: jnp.where(held, new, old), new_state, state)
  message = floats if next_message is None else [
      next_message(s, g).astype(g.dtype) for s, g in zip(synced, floats)]
  dtype = state.pending.message.dtype
  kept = [m for m, d in zip(message, dense) if d]
  vec = split.layout.flatten(method_leaves(message, dense), dtype)
  if kept:
    vec = jnp.concatenate([vec, flat_vector.concat(kept, dtype)])
  return synced, new_state._replace(pending=Pending(vec[None], jnp.ones((1,), bool)))
