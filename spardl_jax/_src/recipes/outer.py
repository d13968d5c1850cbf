"""Syncing rarely: a DiLoCo-style outer loop whose pseudo-gradient goes through a sync.

Every replica (device of the data axis) runs ``every`` inner optimizer steps on its own
gradients with no communication; then the replicas' parameter changes (the pseudo-gradient)
are averaged by a gradient sync (:func:`spardl_jax.sync_gradients`: SparDL, dense, or any
registered method, its residual carrying what it did not send to the next round) and an
outer optimizer applies the average (DiLoCo: Nesterov SGD, lr 0.7, momentum 0.9).

The parameters the train step holds are the **global** ones (the anchor of the round,
identical on every device, what a checkpoint saves and what evaluation sees); each replica's
drift from them lives in the state, per device, and :func:`replica_params` adds it for the
gradient. The returned update is zero on inner steps and the outer step on the last, so the
parameters after an outer step are bit-identical on every device by construction.

References:
  Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
  arXiv 2311.08105. Sarfi et al., "SparseLoCo", arXiv 2508.15706 (top-k of the
  pseudo-gradient with low-bit values and error feedback).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from spardl_jax._src.core import protocol
from spardl_jax._src.core.protocol import MEAN, PER_REPLICA, REPLICATED, Field
from spardl_jax._src.core.config import check_number
from spardl_jax._src.sync.placement import ParamLayout, state_specs
from spardl_jax._src.sync.moves import moves_the_point
from spardl_jax._src.sync.specs import leaf_specs
from spardl_jax._src.sync.sync_state import SyncState, check_sync_alone, states_in
from spardl_jax._src.sync.transform import sync_gradients

__all__ = ['DiLoCoState', 'diloco', 'sparseloco', 'find_outer', 'replica_params']


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Period:
  """The ``every`` a :class:`DiLoCoState` was built for: part of its pytree structure (no
  array), so a step of another period refuses it (its count would end the rounds at other
  steps). Nothing is stored in a checkpoint for it."""

  every: int


@protocol.layout(count=Field(REPLICATED), offset=Field(PER_REPLICA, MEAN),
                 inner=Field(PER_REPLICA, MEAN))
class DiLoCoState(NamedTuple):
  """State of :func:`diloco`.

  Attributes:
    count: () int32, inner steps taken (the same on every device).
    offset: this replica's parameters minus the global ones, shaped like the parameters
      with a leading device axis (``(1, ...)`` on a device, ``(P, ...)`` globally); zero
      right after an outer step. A restore onto another replica count gives every replica
      the mean, so the mean pseudo-gradient the next outer step syncs is unchanged.
    inner: the inner optimizer's state, per replica (a leading device axis on every leaf).
    sync: the sync's :class:`~spardl_jax.SyncState` (its residual is the error feedback of
      the pseudo-gradient).
    outer: the outer optimizer's state (the same on every device).
    period: the :class:`Period` the state was built for (no array).
  """

  count: jax.Array  # type: ignore[assignment]  # a field named count shadows tuple.count
  offset: Any
  inner: Any
  sync: Any
  outer: Any
  period: Period


def _check(every, inner, sync, outer) -> None:
  # The step count is an int32 on the device.
  check_number("diloco", "every (inner steps per outer step)", every,
               "an int in [1, 2**31 - 1]", integral=True, accept=lambda e: 1 <= e < 2**31)
  for name, tx in (("inner", inner), ("sync", sync), ("outer", outer)):
    if not isinstance(tx, optax.GradientTransformation):
      raise TypeError(f"diloco: {name} must be an optax.GradientTransformation, got "
                      f"{type(tx).__name__}.")


def diloco(inner: optax.GradientTransformation, sync: optax.GradientTransformation, *,
           every: int, outer: optax.GradientTransformation | None = None
           ) -> optax.GradientTransformationExtraArgs:
  """An outer loop: ``every`` local steps of ``inner`` per replica, then the mean change
  through ``sync`` and one step of ``outer``.

  ``update(grads, state, params)`` runs inside the data-parallel ``jax.shard_map`` with
  ``params`` the global parameters and ``grads`` this device's gradient **at**
  ``replica_params(state, params)``. On inner steps it returns zeros (the global parameters
  stay) and moves this replica's offset by ``inner``'s update; a replica whose gradient is
  not finite skips its own inner step (no collective runs there, so deciding per device is
  safe). On every ``every``-th step the pseudo-gradient ``-offset`` (the global parameters
  minus the replica's, DiLoCo's sign) is averaged by ``sync``, ``outer`` turns the mean into
  the update every device returns, and the offsets restart at zero. Only that step
  communicates (a ``lax.cond`` on the step count, which every device agrees on). If the
  sync skips a non-finite pseudo-gradient (its ``nonfinite='skip'``), that round is dropped
  on every replica: the mean is zero and the offsets restart; the residual is kept.

  With ``every=1``, ``inner=optax.sgd(lr)``, ``outer=optax.sgd(1.0)`` and a sync at density
  1 this is per-step sync training with ``optax.sgd(lr)``, to float32 rounding.

  Example (DiLoCo with a SparDL outer sync at 3 %, 4-bit values; ``docs/design.md``,
  "Outer loop"; ``benchmarks/results/outer.md`` measures it):

    >>> import jax, jax.numpy as jnp, optax, spardl_jax as sj
    >>> mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    >>> tx = sj.diloco(optax.sgd(0.05, momentum=0.9), sj.spardl(density=0.03, wire="int4"),
    ...                every=30, outer=optax.sgd(0.7, momentum=0.5, nesterov=True))
    >>> state = sj.init_opt_state(tx, {"w": jnp.zeros((100, 10))}, mesh)
    >>> state.offset["w"].shape, state.sync.method_state.residual.shape
    ((8, 100, 10), (8, 1000))

  Args:
    inner: the optimizer of the inner steps (any optax transformation without a sync).
    sync: the pseudo-gradient's sync (:func:`spardl_jax.spardl`,
      :func:`spardl_jax.sync_gradients`), over the data axis.
    every: inner steps per outer step (DiLoCo's ``H``), a positive int.
    outer: the outer optimizer; default DiLoCo's ``optax.sgd(0.7, momentum=0.9,
      nesterov=True)``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`DiLoCoState`;
    its ``update``'s extra arguments go to ``sync`` (``param_specs``, say).
  """
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True) if outer is None else outer
  _check(every, inner, sync, outer)
  sync = optax.with_extra_args_support(sync)  # it takes the sync's param_specs

  def init_fn(params):
    sync_state = sync.init(params)
    check_sync_alone(sync_state, "diloco", "averages the pseudo-gradient over the data axis")
    inner_state = inner.init(params)
    if states_in(inner_state, SyncState):
      raise ValueError("diloco: inner holds a gradient sync; the inner steps run on each "
                       "replica alone. Pass the sync as sync=, and the optimizer alone as "
                       "inner=.")
    lead = sync_state.count.shape[0]  # 1 inside shard_map, P outside

    def per_device(a):
      a = jnp.asarray(a)
      return jnp.broadcast_to(a[None], (lead, *a.shape))

    offset = jax.tree.map(lambda p: jnp.zeros((lead, *jnp.shape(p)), jnp.result_type(p)),
                          params)
    state = DiLoCoState(jnp.zeros((), jnp.int32), offset,
                        jax.tree.map(per_device, inner_state), sync_state, outer.init(params),
                        Period(every))
    return state if lead == 1 else _placed_like_the_sync(state, params)

  def update_fn(grads, state, params=None, **extra_args):
    if not isinstance(state, DiLoCoState):
      raise TypeError(f"diloco: state must be the DiLoCoState from init, got "
                      f"{type(state).__name__}.")
    if state.period != Period(every):
      raise ValueError(f"diloco: the state was built for every={state.period.every}, this "
                       f"step has every={every}; init with the same diloco.")
    if params is None:
      raise ValueError("diloco: update needs params (the global parameters): "
                       "tx.update(grads, state, params).")
    offset = jax.tree.map(lambda a: a[0], state.offset)
    inner_state = jax.tree.map(lambda a: a[0], state.inner)
    local = optax.apply_updates(params, offset)
    step, new_inner = inner.update(grads, inner_state, local)
    finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)
                                  if jnp.issubdtype(g.dtype, jnp.inexact)]))
    new_inner = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_inner,
                             inner_state)
    offset = jax.tree.map(lambda o, s: jnp.where(finite, o + s, o).astype(o.dtype), offset,
                          step)

    def outer_step(offset, sync_state, outer_state):
      pseudo = jax.tree.map(jnp.negative, offset)
      mean, sync_state = sync.update(pseudo, sync_state, params, **extra_args)
      update, outer_state = outer.update(mean, outer_state, params)
      return update, jax.tree.map(jnp.zeros_like, offset), sync_state, outer_state

    def inner_step(offset, sync_state, outer_state):
      return jax.tree.map(jnp.zeros_like, params), offset, sync_state.idle(), outer_state

    last = (state.count + 1) % every == 0
    update, offset, sync_state, outer_state = jax.lax.cond(
        last, outer_step, inner_step, offset, state.sync, state.outer)
    return update, DiLoCoState(state.count + 1, jax.tree.map(lambda a: a[None], offset),
                               jax.tree.map(lambda a: a[None], new_inner), sync_state,
                               outer_state, state.period)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def sparseloco(inner: optax.GradientTransformation, *, every: int, density: float = 0.03,
               decay: float = 0.95, lr: float = 1.0, method: str = "sparseloco",
               **sync_options) -> optax.GradientTransformationExtraArgs:
  """SparseLoCo's outer loop: ``every`` local steps of ``inner``, then each replica's
  pseudo-gradient added to its decayed error feedback (``e <- decay e + delta``), the
  compressed part of ``e`` averaged, and a plain outer step ``-lr * mean``: no outer
  momentum (the decayed accumulator stands in for it).

  That is :func:`diloco` with ``sync_gradients(method, density=density,
  residual_decay=decay, **sync_options)`` and ``outer=optax.sgd(lr)``. The default
  ``method`` is SparseLoCo's own aggregation (chunked top-k, 2-bit values, every selection
  gathered: :mod:`spardl_jax._src.baselines.sparseloco`); ``method="spardl"`` puts SparDL's
  sync under the same rule (its result keeps about ``k`` entries, not their union).

  Example:

    >>> import jax, jax.numpy as jnp, optax, spardl_jax as sj
    >>> mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    >>> tx = sj.sparseloco(optax.adamw(1e-3), every=30, density=0.02)
    >>> state = sj.init_opt_state(tx, {"w": jnp.zeros((100, 10))}, mesh)
    >>> state.sync.method_state.residual.shape
    (8, 1000)

  Args:
    inner: the optimizer of the inner steps (DiLoCo's and SparseLoCo's: AdamW).
    every: inner steps per outer step (``H``).
    density: fraction of each chunk (SparDL: of each block) sent, in (0, 1].
    decay: the error feedback's decay ``beta`` in [0, 1].
    lr: the outer step's rate (> 0).
    method: the registered method that averages the compressed accumulator.
    **sync_options: the method's other options (``chunk``, ``bits`` for SparseLoCo's;
      ``wire`` for SparDL's) and :func:`~spardl_jax.sync_gradients`' (``axis_name``, ...).

  References:
    Sarfi, Thérien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with
    SparseLoCo", arXiv 2508.15706 (Algorithm 1: the decayed error feedback in place of
    DiLoCo's outer Nesterov momentum).
  """
  check_number("sparseloco", "lr", lr, "a finite number > 0",
               accept=lambda a: 0 < a < float("inf"))
  sync = sync_gradients(method, density=density, residual_decay=decay, **sync_options)
  return diloco(inner, sync, every=every, outer=optax.sgd(lr))


def _placed_like_the_sync(state: DiLoCoState, params) -> DiLoCoState:
  """Outside ``shard_map`` (``tx.init`` under ``jax.set_mesh``, as Linen's
  ``TrainState.create`` calls it): the sync already built its rows on their devices; the
  replicas' offsets and inner state, made here as one array, go on the data axis the same
  way (each replica its row), the rest as the state types declare
  (:mod:`spardl_jax._src.sync.placement`). Where the sync's rows show no layout (traced on
  ``Auto`` axes) the compiler places them."""
  rows = state.sync.count
  sharding = getattr(rows, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    sharding = getattr(jax.typeof(rows), "sharding", None)
  if not isinstance(sharding, NamedSharding) or not sharding.spec or sharding.spec[0] is None:
    return state
  leaves = jax.tree.leaves(params)
  layout = ParamLayout(jax.tree.structure(params), tuple(leaf_specs(params)),
                       tuple(tuple(jnp.shape(x)) for x in leaves))
  specs = state_specs(state, PartitionSpec(sharding.spec[0]), layout)
  return jax.device_put(state, jax.tree.map(
      lambda spec: NamedSharding(sharding.mesh, spec), specs,
      is_leaf=lambda x: isinstance(x, PartitionSpec)))


@moves_the_point(0)
def _at_the_replica(tx, opt_state, params):
  del tx  # the state alone says where the replica is
  return replica_params(opt_state, params)


def replica_params(opt_state, params):
  """This replica's parameters, ``params`` plus its :class:`DiLoCoState` offset, inside the
  data-parallel ``shard_map`` (the point the gradient is taken at); ``params`` unchanged
  when ``opt_state`` holds no outer loop."""
  found = find_outer(opt_state)
  if found is None:
    return params
  return optax.apply_updates(params, jax.tree.map(lambda a: a[0], found.offset))


def find_outer(opt_state) -> DiLoCoState | None:
  """The :class:`DiLoCoState` inside an optimizer state, or None.

  Raises:
    ValueError: if it holds several.
  """
  found = states_in(opt_state, DiLoCoState)
  if len(found) > 1:
    raise ValueError(f"spardl_jax: the optimizer state holds {len(found)} outer loops "
                     f"(diloco); nest none in another.")
  return found[0] if found else None
