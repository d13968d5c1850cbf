"""The stages of one gradient sync, as :func:`spardl_jax.sync_gradients` runs them.

``update`` on one device (inside ``shard_map`` over every axis the sync needs bound):

1. :func:`check_state`: the state is this sync's, for gradients of these leaves;
2. :func:`local_gradient`: DGC's local clipping and momentum correction;
3. :func:`run_level`: the method of the current level (dense warm-up, a density of the
   schedule) all-reduces the flat vector, chosen by the step count with ``lax.switch``
   (after decaying the residual, where ``residual_decay`` asks);
4. :func:`agree_on_nonfinite`: DGC's momentum factor masking, and the non-finite guard every
   device agrees on;
5. :func:`next_stats`: this sync's :class:`~spardl_jax.SyncStats`;
6. the synced vector cut back into the leaves (:meth:`FlatLayout.unflatten`).

:func:`init` and :func:`update` are the transformation's entries: they open a ``shard_map``
over the mesh axes a partial-auto one left to the compiler (or over every axis, for ``init``
outside ``shard_map`` under a mesh), so the stages always see local shards. Every function
takes the validated :class:`SyncOptions` explicitly.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from spardl_jax.baselines.dense import formula as dense_formula
from spardl_jax.core import flat as flat_vector
from spardl_jax.core import nonfinite as nonfinite_policy
from spardl_jax.core import protocol
from spardl_jax.core.allreduce import axis_size, bound_axes
from spardl_jax.core.config import check_number
from spardl_jax.core.nonfinite import NonFinite
from spardl_jax.sync import levels
from spardl_jax.sync.flat_layout import FlatLayout, columns, free_axes
from spardl_jax.sync.placement import device_spec
from spardl_jax.sync.specs import (check_leaf_specs, check_same_specs, check_spec_tree,
                                   context_specs, leaf_specs, restrict, specs_shown)
from spardl_jax.sync.state import LeafShapes, Pending, SyncState, SyncStats

__all__ = ['SyncOptions', 'init', 'update', 'init_local', 'update_local', 'check_state',
           'local_gradient', 'run_level', 'agree_on_nonfinite', 'next_stats',
           'level_index', 'Leaves', 'split_leaves', 'merge_float_leaves', 'with_float_leaves',
           'UNORDERED_COLLECTIVES',
           'waits_for_gradient', 'message_size', 'unpack', 'hold', 'LevelRun', 'Agreed']


@dataclasses.dataclass(frozen=True, eq=False)
class SyncOptions:
  """The options of one :func:`spardl_jax.sync_gradients`, validated once (see its
  docstring for each); ``levels`` are the sync's levels, not yet bound to leaf shapes."""

  method: str
  levels: tuple[levels.Level, ...]
  axis_name: str = "data"
  axis_size: int | None = None
  nonfinite: NonFinite = "skip"
  momentum: float | None = None
  momentum_masking: bool = True
  clip_norm: float | None = None
  param_specs: Any = None
  local_axis: str | None = None
  residual_decay: float | None = None
  dense_leaves: Any = None
  delay: int = 0

  def __post_init__(self):
    who = "sync_gradients"
    nonfinite_policy.check_policy(who, self.nonfinite)
    if isinstance(self.delay, bool) or self.delay not in (0, 1):
      raise ValueError(f"sync_gradients: delay must be 0 (each step's own gradient) or 1 "
                       f"(each step sends the last step's gradient), got {self.delay!r}.")
    check_dense_leaves(self.dense_leaves)
    if self.dense_leaves is not None and self.momentum is not None:
      raise ValueError(f"{who}: dense_leaves={self.dense_leaves!r} with momentum="
                       f"{self.momentum}: DGC's momentum correction keeps one velocity for "
                       f"the sparse vector only; use the optimizer's momentum after the sync "
                       f"(optax.sgd(lr, momentum=...)), or drop dense_leaves.")
    if self.residual_decay is not None:
      check_number(who, "residual_decay", self.residual_decay, "None or a number in [0, 1]",
                   accept=lambda b: 0 <= b <= 1)
    if self.momentum is not None:
      check_number(who, "momentum", self.momentum, "None or a number in [0, 1)",
                   accept=lambda m: 0 <= m < 1)
    if not isinstance(self.momentum_masking, bool):
      raise ValueError(f"{who}: momentum_masking must be True or False, got "
                       f"{self.momentum_masking!r}.")
    if self.clip_norm is not None:
      check_number(who, "clip_norm", self.clip_norm, "None or a finite number > 0",
                   accept=lambda c: 0 < c < float("inf"))
    if self.axis_size is not None:
      check_number(who, "axis_size", self.axis_size, "a positive int", integral=True,
                   accept=lambda p: p >= 1)
    if self.local_axis is not None and (not isinstance(self.local_axis, str)
                                        or self.local_axis == self.axis_name):
      raise ValueError(f"{who}: local_axis must be None or the name of a mesh axis other "
                       f"than axis_name={self.axis_name!r}, got {self.local_axis!r}.")

  def is_dense(self, shape: tuple[int, ...]) -> bool:
    """Whether a float leaf of this (local) shape is averaged densely, outside the method."""
    rule = self.dense_leaves
    if rule is None:
      return False
    if rule == "vectors":
      return len(shape) <= 1
    if isinstance(rule, int):
      return math.prod(shape) < rule
    return bool(rule(shape))

  @property
  def data_axes(self) -> tuple[str, ...]:
    """The axes the sync reduces over: the data axis, and a host's ``local_axis``."""
    return (self.axis_name,) if self.local_axis is None else (self.axis_name, self.local_axis)

  @property
  def reaches_result(self) -> bool:
    """Whether a non-finite input reaches the result at every level (no agreement round)."""
    return all(level.allreduce.nonfinite_reaches_result for level in self.levels)

  def given_specs(self, door, door_name: str, who: str):
    """The parameters' specs: the transformation's own ``param_specs``, else what came
    through ``door`` (``tx.update``'s extra argument, or ``use_param_specs`` for init);
    where both came, they must agree."""
    check_spec_tree(door, f"{who} ({door_name})", data_axes=self.data_axes)
    if self.param_specs is None:
      return door
    check_spec_tree(self.param_specs, who, data_axes=self.data_axes)
    if door is not None:
      check_same_specs(self.param_specs, door, door_name, who)
    return self.param_specs


DENSE_LEAVES = ("vectors", "an int N (leaves of fewer than N entries)",
                "a callable taking a leaf's shape and returning True to keep it dense")


def check_dense_leaves(rule) -> None:
  """``dense_leaves`` is None, ``"vectors"``, a positive int or a callable."""
  if (rule is None or rule == "vectors" or callable(rule)
      or (isinstance(rule, int) and not isinstance(rule, bool) and rule >= 1)):
    return
  raise ValueError(f"sync_gradients: dense_leaves must be None, {', '.join(DENSE_LEAVES)}; "
                   f"got {rule!r}.")


class Trace(NamedTuple):
  """What an update's gradients fix at trace time: their float leaves' shapes, the flat
  layout, the promoted dtype, the levels bound to those leaves, and the devices ``p`` on
  the data axis."""

  leaves: LeafShapes
  layout: FlatLayout
  dtype: Any
  levels: tuple[levels.Level, ...]
  p: int


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


def _float_leaves(tree) -> tuple[list, Any]:
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
  if not leaves:
    raise ValueError("sync_gradients: the gradient pytree has no floating-point leaves to "
                     "synchronize.")
  return leaves, jnp.result_type(*(x.dtype for x in leaves))


def _shapes(floats) -> LeafShapes:
  return LeafShapes(tuple(tuple(int(d) for d in x.shape) for x in floats))


def _dense_mask(options: SyncOptions, floats) -> list[bool]:
  """Which float leaves ``dense_leaves`` keeps dense; a clear error where it keeps all."""
  mask = [options.is_dense(tuple(x.shape)) for x in floats]
  if options.dense_leaves is not None and all(mask):
    raise ValueError(f"sync_gradients: dense_leaves={options.dense_leaves!r} keeps every "
                     f"leaf dense, so {options.method!r} has nothing to sync; use "
                     f"method='dense', or a rule that leaves some leaves to the method.")
  return mask


def _method_leaves(items: list, dense: list[bool]) -> list:
  """The entries of ``items`` (one per float leaf) the method syncs: those not kept dense."""
  return [item for item, d in zip(items, dense) if not d]


class Leaves(NamedTuple):
  """A tree's float leaves as the sync splits them: all of them in order, their promoted
  ``dtype``, the ``dense`` mask (``dense_leaves``), the ``method``'s leaves and the ``kept``
  dense ones, and the ``layout`` of the method's flat vector."""

  floats: list
  dtype: Any
  dense: list[bool]
  method: list
  kept: list
  layout: FlatLayout


def split_leaves(options: SyncOptions, tree, specs=None, given=None) -> Leaves:
  """``tree``'s float leaves split between the method and ``dense_leaves``, with the
  method's flat layout (:func:`flat_layout`; ``specs`` and ``given`` as there)."""
  floats, dtype = _float_leaves(tree)
  dense = _dense_mask(options, floats)
  return Leaves(floats, dtype, dense, _method_leaves(floats, dense),
                [x for x, d in zip(floats, dense) if d],
                flat_layout(options, tree, floats, specs, given, dense))


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


def flat_layout(options: SyncOptions, tree, floats, specs, given, dense) -> FlatLayout:
  """How this device's float leaves of ``tree`` (but those ``dense`` marks) make its flat
  vector. ``specs``: every leaf's spec over the whole mesh, or None where the caller has
  none (then ``given``, the parameters' specs from a door, are read)."""
  others = columns(options.data_axes)
  float_specs = None
  if others:
    if specs is None:
      if given is None:
        raise ValueError(
            f"sync_gradients: the sync runs inside a shard_map over the mesh axes "
            f"{tuple(others)} besides {options.axis_name!r}, where each device holds only "
            f"its shards and the sync cannot see which parameters are replicated over those "
            f"axes; pass param_specs=<the parameters' PartitionSpecs> (the in_specs of your "
            f"shard_map) to the transformation.")
      specs = leaf_specs(tree, given)
    float_specs = [spec for x, spec in zip(jax.tree.leaves(tree), specs)
                   if jnp.issubdtype(x.dtype, jnp.floating)]
    float_specs = _method_leaves(float_specs, dense)
  layout = FlatLayout.build([x.shape for x in _method_leaves(floats, dense)], float_specs,
                            others, options.local_axis)
  _check_leafwise(options, layout, tuple(others))
  return layout


def _check_leafwise(options: SyncOptions, layout: FlatLayout, others) -> None:
  """A method that compresses each leaf as a matrix cannot take slices of the leaves."""
  if not any(level.allreduce.leafwise for level in options.levels):
    return
  if options.local_axis is not None:
    raise ValueError(f"sync_gradients: {options.method!r} compresses each parameter as a "
                     f"matrix, but local_axis={options.local_axis!r} syncs slices of the flat "
                     f"gradient; use a method that sees one flat vector (sj.methods.names()).")
  if layout.sliced:
    raise ValueError(
        f"sync_gradients: {options.method!r} compresses each parameter as a matrix, but some "
        f"parameters are replicated over the mesh axes {others}, whose slices the sync "
        f"spreads over those axes; shard every parameter over them, or use a method that "
        f"sees one flat vector (sj.methods.names()).")


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


def init_local(options: SyncOptions, params, specs=None, given=None) -> SyncState:
  """The state on this device (or, outside ``shard_map``, every device's rows at once)."""
  lead, p = _devices(options)  # first: the layout needs the axes it names
  split = split_leaves(options, params, specs, given)
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


def local_gradient(options: SyncOptions, flat, dense: list, old_velocity, p: int):
  """Stage 2: DGC's local clipping (of the flat vector and the ``dense`` leaves together),
  then its momentum correction (the velocity is what travels): ``(what the all-reduce sums,
  the dense leaves, the new velocity or None)``."""
  if options.clip_norm is not None:
    norm = jnp.sqrt(sum((jnp.sum(jnp.square(v.astype(jnp.float32))) for v in [flat, *dense]),
                        jnp.zeros((), jnp.float32)))
    limit = options.clip_norm / np.sqrt(p)
    scale = jnp.minimum(1.0, limit / jnp.maximum(norm, 1e-30))
    flat = (flat * scale).astype(flat.dtype)
    dense = [(v * scale).astype(v.dtype) for v in dense]
  if options.momentum is None:
    return flat, dense, None
  velocity = (options.momentum * old_velocity[0] + flat).astype(flat.dtype)
  return velocity, dense, velocity


def _run_one(level: levels.Level, x, local, index, *, n: int, p: int, itemsize: int,
             axis_name, decay: float | None) -> LevelRun:
  """One level's sync of ``x`` (the level ``index``). ``decay`` scales the residual first
  (SparseLoCo's ``e <- beta e + delta``); the state a skipped step restores is the one
  before it."""
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


def level_index(levels_, count) -> jax.Array:
  """The index of the level (of the sequence ``levels_``, ascending starts) that sync
  ``count`` runs."""
  starts = np.array([level.start for level in levels_])
  return (jnp.sum(count >= starts) - 1).astype(jnp.int32)


def run_level(options: SyncOptions, trace: Trace, x, local, count) -> LevelRun:
  """Stage 3: the level of sync ``count`` runs (``lax.switch`` among compiled levels)."""
  run = functools.partial(_run_one, n=trace.layout.n, p=trace.p,
                          itemsize=np.dtype(trace.dtype).itemsize, axis_name=options.axis_name,
                          decay=options.residual_decay)
  if len(trace.levels) == 1:
    return run(trace.levels[0], x, local, jnp.zeros((), jnp.int32))
  starts = np.array([level.start for level in trace.levels])
  index = level_index(trace.levels, count)
  # Entering a sparse level restarts the method's other state for its size; the residual
  # (delivered or still owed mass) carries over.
  entering = jnp.isin(count, starts[1:])
  fresh = fresh_state(options, trace.levels, trace.layout.n, trace.dtype, trace.p)
  owed = protocol.residual(local)
  if owed is not None:
    fresh = fresh._replace(residual=owed)
  local = jax.tree.map(lambda a, b: jnp.where(entering, a, b), fresh, local)
  return jax.lax.switch(index, [functools.partial(run, level) for level in trace.levels],
                        x, local, index)


def agree_on_nonfinite(options: SyncOptions, trace: Trace, x, run: LevelRun, means: list,
                       velocity, old_velocity) -> Agreed:
  """Stage 4: DGC's momentum factor masking, then the non-finite guard every device
  agrees on (the dense leaves' ``means`` included); ``old_velocity`` is what a skipped
  step keeps."""
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


def update_local(options: SyncOptions, updates, state, specs=None, given=None,
                 next_message=None):
  """Every stage on this device's local gradients: ``(the synced gradients, new state)``.
  With ``delay`` the stages run on the message the last step left, and this step's
  gradient (or ``next_message`` of it) is left for the next (:func:`hold`)."""
  p = axis_size(options.axis_name, who="sync_gradients: update")
  leaves, treedef = jax.tree.flatten(updates)
  floats, dtype, dense, sparse, kept, layout = split_leaves(options, updates, specs, given)
  trace = Trace(_shapes(floats), layout, dtype,
                tuple(levels.bind(list(options.levels), [x.shape for x in sparse], p)), p)
  local = check_state(options, state, trace)
  if options.delay:
    message = state.pending.message[0]
    if waits_for_gradient():
      message = _after(message, floats)
    x, kept = unpack(message, layout.n, kept)
  else:
    x = layout.flatten(sparse, dtype)
  x, kept, velocity = local_gradient(options, x, kept, state.velocity, trace.p)
  run = run_level(options, trace, x, local, state.count[0])
  # The dense leaves: one pmean of their concatenation (one all-reduce).
  means = [jax.lax.pmean(flat_vector.concat(kept, dtype), options.data_axes)] if kept else []
  agreed = agree_on_nonfinite(options, trace, x, run, means, velocity, state.velocity)
  new_state = SyncState(jax.tree.map(lambda a: a[None], agreed.run.state),
                        None if agreed.velocity is None else agreed.velocity[None],
                        state.count + 1, next_stats(trace, agreed, state.stats),
                        state.leaves, state.pending)
  synced = merge_float_leaves(dense, layout.unflatten(agreed.run.y, sparse),
                              flat_vector.split(agreed.means[0], kept) if agreed.means else [])
  if options.delay:
    synced, new_state = hold(layout, floats, dense, synced, state, new_state, next_message)
  elif next_message is not None:
    raise ValueError("sync_gradients: update got next_message, which only a delayed sync "
                     "takes (delay=1).")
  return with_float_leaves(treedef, leaves, synced), new_state


def merge_float_leaves(dense: list[bool], method_leaves, dense_leaves) -> list:
  """The float leaves in their order, from the method's and the dense ones (``dense`` marks
  which each is)."""
  from_method, from_dense = iter(method_leaves), iter(dense_leaves)
  return [next(from_dense) if d else next(from_method) for d in dense]


def with_float_leaves(treedef, leaves, floats, other=lambda x: x):
  """The tree of ``leaves`` with its float leaves replaced by ``floats`` (in order) and
  every other leaf by ``other(leaf)``."""
  out = iter(floats)
  return jax.tree.unflatten(treedef, [next(out) if jnp.issubdtype(x.dtype, jnp.floating)
                                      else other(x) for x in leaves])


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


def hold(layout: FlatLayout, floats, dense, synced, state, new_state, next_message):
  """A delayed sync's last stage: ``(what this step delivers, the new state)``.

  Before any message was held (the first step) nothing is delivered and the sync's state
  stays as it was, so the delayed syncs are the undelayed ones one step later, state
  included. This step's message, flattened as the sync flattens a gradient, waits in
  :class:`Pending`: the gradient itself, or ``next_message(synced, gradient)`` leaf by leaf
  (what :func:`spardl_jax.scale_by_synced_adam` sends is formed from this step's result)."""
  held = state.pending.held[0]
  synced = [jnp.where(held, s, jnp.zeros_like(s)) for s in synced]
  new_state = jax.tree.map(lambda new, old: jnp.where(held, new, old), new_state, state)
  message = floats if next_message is None else [
      next_message(s, g).astype(g.dtype) for s, g in zip(synced, floats)]
  dtype = state.pending.message.dtype
  kept = [m for m, d in zip(message, dense) if d]
  vec = layout.flatten(_method_leaves(message, dense), dtype)
  if kept:
    vec = jnp.concatenate([vec, flat_vector.concat(kept, dtype)])
  return synced, new_state._replace(pending=Pending(vec[None], jnp.ones((1,), bool)))


def _local_specs(options: SyncOptions, tree, axes, who: str, given):
  """Each leaf's spec over the mesh (a list) and over the ``axes`` the sync must open
  itself (a tree, for ``shard_map``); a clear error where it cannot know them."""
  mesh = jax.sharding.get_abstract_mesh()
  others = tuple(a for a in axes if a not in options.data_axes and mesh.shape[a] > 1)
  if not others:  # data axes only: the parameters are replicated
    return None, jax.tree.map(lambda _: PartitionSpec(), tree)
  if given is None and not specs_shown(tree, mesh, others):
    raise ValueError(
        f"sync_gradients: {who} runs where the mesh axes {others} are left to the compiler "
        f"(Auto), so the sync cannot see how the parameters are sharded over them; pass "
        f"param_specs=<the parameters' PartitionSpecs> to the transformation, or make "
        f"those mesh axes Explicit.")
  specs = leaf_specs(tree, given)
  check_leaf_specs(tree, specs, dict(mesh.shape), options.data_axes, f"sync_gradients: {who}")
  return specs, jax.tree.unflatten(jax.tree.structure(tree),
                                   [restrict(spec, axes) for spec in specs])


def init(options: SyncOptions, params) -> SyncState:
  """The transformation's ``init``: on local shards wherever it is traced."""
  refuse_apply_if_finite()
  given = options.given_specs(context_specs(), "use_param_specs (init_opt_state and "
                              "opt_state_specs pass the arrays' layout there)",
                              "sync_gradients: init")
  axes = free_axes(options.axis_name)  # a partial-auto shard_map's other axes
  mesh = jax.sharding.get_abstract_mesh()
  if (not axes and options.axis_size is None and not bound_axes()
      and options.axis_name in mesh.axis_names):
    axes = tuple(mesh.axis_names)  # outside shard_map, under a mesh: each device its rows
  if not axes:
    return init_local(options, params, given=given)
  rows = (device_spec(axes, options.axis_name) if options.axis_name in axes
          else PartitionSpec(axes))
  specs, over = _local_specs(options, params, axes, "init", given)
  return jax.shard_map(functools.partial(init_local, options, specs=specs, given=given),
                       in_specs=(over,), out_specs=rows, axis_names=set(axes),
                       check_vma=False)(params)


def update(options: SyncOptions, updates, state, param_specs=None, batch_axes=None,
           next_message=None):
  """The transformation's ``update`` (``param_specs``, ``batch_axes`` and
  ``next_message``: its optax extra arguments)."""
  refuse_apply_if_finite()
  check_batch_axes(options, batch_axes)
  given = options.given_specs(param_specs, "tx.update's param_specs (data_parallel_step "
                              "passes the arrays' layout there)", "sync_gradients: update")
  axes = free_axes(options.axis_name)
  if not axes:
    return update_local(options, updates, state, given=given, next_message=next_message)
  specs, over = _local_specs(options, updates, axes, "update", given)
  rows = jax.tree.map(lambda _: PartitionSpec(axes), state)
  return jax.shard_map(functools.partial(update_local, options, specs=specs, given=given,
                                         next_message=next_message),
                       in_specs=(over, rows), out_specs=(over, rows), axis_names=set(axes),
                       check_vma=False)(updates, state)


def check_batch_axes(options: SyncOptions, batch_axes) -> None:
  """The axes a step split its batch over (:func:`spardl_jax.data_parallel_step` says,
  through ``tx.update``'s extra argument ``batch_axes``) must be the axes the sync reduces
  over: a step split over a host's ``local_axis`` too, with a sync that does not reduce
  over it, would average each slice of the vector over part of the batch."""
  if batch_axes is None or tuple(batch_axes) == options.data_axes:
    return
  if len(batch_axes) > len(options.data_axes):
    raise ValueError(
        f"sync_gradients: update: the step splits the batch over {tuple(batch_axes)}, but "
        f"this sync reduces over {options.data_axes} only; build it with "
        f"local_axis={batch_axes[-1]!r}, or drop the step's local_axis.")
  raise ValueError(
      f"sync_gradients: update: this sync reduces over {options.data_axes} "
      f"(local_axis={options.local_axis!r}), but the step splits the batch over "
      f"{tuple(batch_axes)}; give the step local_axis={options.local_axis!r} too, or build "
      f"the sync with the step's axes.")


@functools.cache
def _apply_if_finite_code() -> frozenset:
  wrapped = optax.apply_if_finite(optax.identity(), 1)
  return frozenset({wrapped.init.__code__, wrapped.update.__code__})


def refuse_apply_if_finite() -> None:
  """Raises when ``optax.apply_if_finite`` is calling this sync's init or update.

  It decides on each device's own gradient, before the sync, whether to run it (a
  ``lax.cond``): a device with a NaN skips the collectives the others wait in (a hang, then
  an abort after 40 s on CPU). Nothing the sync is handed shows the wrapper: it receives
  only its own state and the gradients, the wrapper's state sits above it, a state can be
  built by ``tx.init`` under ``shard_map``, with ``axis_size`` or with ``init_opt_state``,
  and JAX has no public way to ask whether a trace is inside a ``cond`` branch. So the
  check looks for the wrapper's own functions among the callers: one walk of the Python
  stack at trace time, nothing in the compiled step.
  """
  codes = _apply_if_finite_code()
  frame = inspect.currentframe()
  while frame is not None:
    if frame.f_code in codes:
      raise ValueError(
          "sync_gradients: optax.apply_if_finite wraps a gradient sync. It decides on each "
          "device's own gradient before the sync runs, so a device with a NaN would skip "
          "the collectives the others wait in (a hang). The sync agrees on every device "
          "itself: use nonfinite='skip' (the default), which zeroes that step's update "
          "everywhere and keeps the residuals; wrap only optimizers that come after the "
          "sync.")
    frame = frame.f_back
