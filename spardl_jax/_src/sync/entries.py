"""The transformation's entries: :func:`init`, :func:`update` and :func:`on_local_shards` open
a ``shard_map`` over the mesh axes a partial-auto one left to the compiler (or over every
axis, for ``init`` outside ``shard_map`` under a mesh), so that the stages
(:mod:`spardl_jax._src.sync.stages`) always see local shards, and build the trace's one
:class:`~spardl_jax._src.sync.plan.SyncPlan` there."""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec

from spardl_jax._src.core.allreduce import axis_size, bound_axes
from spardl_jax._src.sync.guards import check_batch_axes, refuse_apply_if_finite
from spardl_jax._src.sync.packing import free_axes
from spardl_jax._src.sync.placement import device_spec
from spardl_jax._src.sync.plan import GivenSpecs, SyncPlan
from spardl_jax._src.sync.settings import SyncOptions
from spardl_jax._src.sync.specs import (check_leaf_specs, context_specs, leaf_specs, restrict,
                                        specs_shown)
from spardl_jax._src.sync.stages import init_local, update_local
from spardl_jax._src.sync.sync_state import SyncState

__all__ = ['init', 'update', 'on_local_shards']


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


def _devices(options: SyncOptions) -> tuple[int, int]:
  """``(lead, p)`` for ``init``: the leading device axis of the state it creates here, and
  the number of devices on the data axis."""
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


def _init_here(options: SyncOptions, params, where: GivenSpecs) -> SyncState:
  lead, p = _devices(options)  # first: the plan needs the axes it names
  return init_local(SyncPlan.build(options, params, p, where), lead)


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
    return _init_here(options, params, GivenSpecs(params=given))
  rows = (device_spec(axes, options.axis_name) if options.axis_name in axes
          else PartitionSpec(axes))
  specs, over = _local_specs(options, params, axes, "init", given)
  return jax.shard_map(
      lambda tree: _init_here(options, tree, GivenSpecs(specs, given)), in_specs=(over,),
      out_specs=rows, axis_names=set(axes), check_vma=False)(params)


def update(options: SyncOptions, updates, state, param_specs=None, batch_axes=None,
           next_message=None, extra_bytes=0):
  """The transformation's ``update`` (``param_specs``, ``batch_axes``, ``next_message`` and
  ``extra_bytes``: its optax extra arguments)."""
  refuse_apply_if_finite()
  check_batch_axes(options, batch_axes)
  given = options.given_specs(param_specs, "tx.update's param_specs (data_parallel_step "
                              "passes the arrays' layout there)", "sync_gradients: update")
  return on_local_shards(
      options, lambda plan, tree, local: update_local(plan, tree, local, next_message,
                                                      extra_bytes),
      updates, state, given=given, who="update", returns_state=True)


def on_local_shards(options: SyncOptions, local, tree, state, *, given, who: str,
                    returns_state: bool):
  """``local(plan, tree, state)`` on this device's shards of ``tree`` (like the parameters)
  and rows of ``state`` (the sync's), with the trace's :class:`SyncPlan` of ``tree``: itself
  where every axis the sync needs is bound, else in a ``shard_map`` over the mesh axes a
  partial-auto one left open. ``local`` returns a tree like ``tree``, or ``(tree, state)``
  with ``returns_state``; ``given`` are the parameters' specs from a door, ``who`` names the
  caller in errors."""
  def here(tree, state, where: GivenSpecs):
    p = axis_size(options.axis_name, who=f"sync_gradients: {who}")
    return local(SyncPlan.build(options, tree, p, where), tree, state)

  axes = free_axes(options.axis_name)
  if not axes:
    return here(tree, state, GivenSpecs(params=given))
  specs, over = _local_specs(options, tree, axes, who, given)
  rows = jax.tree.map(lambda _: PartitionSpec(axes), state)
  return jax.shard_map(functools.partial(here, where=GivenSpecs(specs, given)),
                       in_specs=(over, rows), out_specs=(over, rows) if returns_state else over,
                       axis_names=set(axes), check_vma=False)(tree, state)
