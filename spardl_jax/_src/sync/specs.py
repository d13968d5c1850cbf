"""The parameters' ``PartitionSpec`` s: where the sync learns how the parameters are sharded.

The sync reduces over the data axis; the parameters may be sharded over the mesh's other axes
(FSDP, tensor parallelism), and the sync must know how, since each device syncs its own shards.
That knowledge reaches it through three named doors, read in this order:

1. ``param_specs=`` of the transformation (:func:`spardl_jax.sync_gradients`): the user's word;
2. ``param_specs=`` passed to ``tx.update`` as an optax extra argument (``optax.chain`` and
   ``optax.MultiSteps`` forward it): what :func:`spardl_jax.data_parallel_step` reads from the
   arrays before it traces its step;
3. :func:`use_param_specs`, a tracing context for ``tx.init`` (optax's ``init`` takes no extra
   arguments): :func:`spardl_jax.init_opt_state` and :func:`spardl_jax.opt_state_specs` trace
   ``tx.init`` inside it, and a user who calls ``tx.init`` in a ``shard_map`` of their own may
   too, as ``jax.set_mesh`` names a mesh for what is traced inside it.

Without any of them the sync reads each leaf's own sharding: a placed array's or
``jax.ShapeDtypeStruct`` 's ``NamedSharding``, or its type's on ``Explicit`` mesh axes
(:func:`leaf_specs`). A value traced on ``Auto`` axes shows none (:func:`specs_shown`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ['use_param_specs', 'check_spec_tree', 'context_specs', 'check_axis', 'axes_of',
           'leaf_specs', 'check_same_specs', 'specs_shown', 'check_leaf_specs', 'local_shape',
           'restrict']

_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("spardl_jax.use_param_specs",
                                                          default=None)


@contextlib.contextmanager
def use_param_specs(param_specs):
  """A tracing context: every gradient sync whose ``init`` is traced inside it takes
  ``param_specs`` (a pytree of the parameters' structure holding ``PartitionSpec`` s, None
  for replicated) as the parameters' layout over the mesh, where it cannot read it from them.

  ``tx.init`` inside a ``shard_map`` over every mesh axis sees only each device's shards,
  and on ``Auto`` axes a traced value does not say how it is sharded; ``init`` takes no
  extra arguments, so this is its door. The transformation's own ``param_specs=`` wins.

  Example:

    >>> import jax, jax.numpy as jnp, optax, spardl_jax as sj
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
    >>> tx = sj.spardl(density=0.1)
    >>> specs = {"w": P(None, "model"), "b": P()}
    >>> init = jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,),
    ...                      out_specs=P(("data", "model")), check_vma=False)
    >>> params = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32,
    ...                                     sharding=jax.NamedSharding(mesh, specs["w"])),
    ...           "b": jax.ShapeDtypeStruct((6,), jnp.float32,
    ...                                     sharding=jax.NamedSharding(mesh, specs["b"]))}
    >>> with sj.use_param_specs(specs):
    ...   state = jax.eval_shape(init, params)
    >>> state.method_state.residual.shape  # per device: w's 8x2 shard and b's 6/2 slice
    (8, 19)
  """
  check_spec_tree(param_specs, "use_param_specs")
  token = _CONTEXT.set(param_specs)
  try:
    yield
  finally:
    _CONTEXT.reset(token)


def check_spec_tree(param_specs, who: str, mesh=None, data_axes: tuple[str, ...] = ()) -> None:
  """A clear error unless ``param_specs`` is a pytree of ``PartitionSpec`` s and Nones (a
  bare axis name is not a spec) whose axes are ``mesh``'s (where one is given, or set) and
  none of the ``data_axes`` (the sync reduces over them)."""
  if param_specs is None:
    return
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
  names = tuple(mesh.axis_names) if mesh is not None and mesh.axis_names else None
  for path, spec in jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=_is_spec)[0]:
    where = jax.tree_util.keystr(path) or "param_specs"
    if not _is_spec(spec):
      raise ValueError(f"{who}: param_specs must hold a PartitionSpec (or None for "
                       f"replicated) per parameter, got {spec!r} at {where}; write "
                       f"PartitionSpec({spec!r}) for a leaf sharded over that axis.")
    for axis in (a for entry in (spec or ()) for a in axes_of(entry)):
      if names is not None and axis not in names:
        raise ValueError(f"{who}: param_specs names the axis {axis!r} at {where}, which is "
                         f"not in the mesh {names}.")
      if axis in data_axes:
        raise _over_data_axis(who, where, axis, spec, data_axes, names or ())


def context_specs():
  """The specs of the innermost :func:`use_param_specs`, or None."""
  return _CONTEXT.get()


def check_axis(mesh, axis_name, who: str, name: str = "axis_name") -> None:
  """A clear error unless ``axis_name`` (the parameter ``name``) is an axis of ``mesh``."""
  if not isinstance(axis_name, str) or axis_name not in mesh.axis_names:
    raise ValueError(f"{who}: {name}={axis_name!r} is not an axis of the mesh; its axes "
                     f"are {tuple(mesh.axis_names)}.")


def axes_of(entry) -> tuple:
  """The mesh axes one entry of a ``PartitionSpec`` names: ``()`` for None, a tuple for
  several (Orbax's metadata writes them as a list)."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _is_spec(x) -> bool:
  return x is None or isinstance(x, PartitionSpec)


def leaf_specs(tree, param_specs=None) -> list[PartitionSpec]:
  """One ``PartitionSpec`` per leaf of ``tree``: from ``param_specs`` (a pytree of specs of
  ``tree``'s structure, ``None`` for replicated) when given, else the leaf's own sharding (a
  concrete array's ``NamedSharding``, a ``jax.ShapeDtypeStruct``'s, or its type's under
  ``Explicit`` mesh axes), else replicated. Given specs that disagree with a layout a leaf
  shows by itself are refused (the sync would cut each device's vector from shards it
  does not hold)."""
  leaves = jax.tree.leaves(tree)
  if param_specs is None:
    return [PartitionSpec() if own is None else own.spec
            for own, _ in map(_own_layout, leaves)]
  specs = [PartitionSpec() if s is None else s
           for s in jax.tree.leaves(param_specs, is_leaf=_is_spec)]
  if len(specs) != len(leaves):
    raise ValueError(f"param_specs has {len(specs)} entries, but the parameters have "
                     f"{len(leaves)} leaves; give one PartitionSpec (or None) per leaf.")
  for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(tree)[0], specs):
    own, shown = _own_layout(x)
    if own is not None and _over(spec, shown) != _over(own.spec, shown):
      raise ValueError(
          f"param_specs gives parameter {jax.tree_util.keystr(path) or 'params'} the layout "
          f"{spec}, but it is sharded {own.spec}; give the specs the arrays have, or leave "
          f"param_specs out where the arrays show their layout (placed arrays, Explicit mesh "
          f"axes).")
  return specs


def check_same_specs(own, door, door_name: str, who: str) -> None:
  """A clear error where the transformation's own ``param_specs`` and those a door brings
  (``door_name`` says which) give a parameter different layouts over the mesh's axes of
  size > 1."""
  mesh = jax.sharding.get_abstract_mesh()
  axes = {a for a in mesh.axis_names if mesh.shape[a] > 1} if mesh.axis_names else None
  flat = jax.tree_util.tree_flatten_with_path(own, is_leaf=_is_spec)[0]
  theirs = jax.tree.leaves(door, is_leaf=_is_spec)
  if len(theirs) != len(flat):
    return  # leaf_specs names the count that does not fit the parameters
  for (path, mine), other in zip(flat, theirs):
    if _over(mine, axes) != _over(other, axes):
      raise ValueError(
          f"{who}: param_specs of the transformation gives parameter "
          f"{jax.tree_util.keystr(path) or 'params'} the layout {mine or PartitionSpec()}, "
          f"but {door_name} gives {other or PartitionSpec()}; give the specs the arrays "
          f"have (or drop the transformation's param_specs).")


def _own_layout(x) -> tuple[NamedSharding | None, set | None]:
  """A leaf's own ``NamedSharding`` and the mesh axes it speaks for: every axis for a
  placed array's or a ``jax.ShapeDtypeStruct``'s, the ``Explicit`` ones for a traced
  value's type (on ``Auto`` axes a type says replicated, whatever the value is)."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding):
    return sharding, None
  try:
    sharding = jax.typeof(x).sharding
  except (TypeError, AttributeError):  # a Python scalar or an unsharded stand-in
    return None, None
  if not isinstance(sharding, NamedSharding):
    return None, None
  mesh = sharding.mesh
  return sharding, {a for a, kind in zip(mesh.axis_names, mesh.axis_types)
                    if kind == jax.sharding.AxisType.Explicit}


def _over(spec, axes) -> tuple:
  """``spec`` as the mesh axes (of ``axes``; all where None) each dimension is sharded
  over, trailing unsharded dimensions dropped: two specs of one layout compare equal."""
  dims = [tuple(a for a in axes_of(entry) if axes is None or a in axes)
          for entry in (spec or ())]
  while dims and not dims[-1]:
    dims.pop()
  return tuple(dims)


def specs_shown(tree, mesh, axes) -> bool:
  """Whether the leaves of ``tree`` show their layout over the mesh ``axes`` without
  ``param_specs``: those axes are ``Explicit`` (a traced value's type then names them), or
  every leaf is placed (an array or ``jax.ShapeDtypeStruct`` with a ``NamedSharding``). A
  value traced on ``Auto`` axes shows none: its type says replicated, whatever it is."""
  explicit = all(mesh.axis_types[mesh.axis_names.index(a)] == jax.sharding.AxisType.Explicit
                 for a in axes)
  return explicit or all(isinstance(getattr(x, "sharding", None), NamedSharding)
                         for x in jax.tree.leaves(tree))


def check_leaf_specs(tree, specs, shape: dict, data_axes: tuple[str, ...], who: str) -> None:
  """Clear errors for a leaf sharded over one of the ``data_axes`` or over an axis that does
  not divide it (``shape`` maps mesh axes to sizes)."""
  paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  for path, x, spec in zip(paths, jax.tree.leaves(tree), specs):
    name = path or "params"
    for dim, entry in enumerate(spec):
      for axis in axes_of(entry):
        if axis in data_axes:
          raise _over_data_axis(who, name, axis, spec, data_axes, tuple(shape))
        if axis not in shape:
          raise ValueError(f"{who}: parameter {name} names the axis {axis!r}, which is not in "
                           f"the mesh {tuple(shape)}.")
      if dim >= len(x.shape):
        raise ValueError(f"{who}: parameter {name} of shape {tuple(x.shape)} cannot be "
                         f"sharded {spec}: it has no dimension {dim}.")
      size = math.prod(shape[axis] for axis in axes_of(entry))
      if x.shape[dim] % size:
        raise ValueError(
            f"{who}: parameter {name} of shape {tuple(x.shape)} cannot be sharded {spec}: "
            f"dimension {dim} must be divisible by {size} (the mesh axes {axes_of(entry)}).")


def _over_data_axis(who: str, name: str, axis: str, spec, data_axes: tuple[str, ...],
                    mesh_axes: tuple[str, ...]) -> ValueError:
  """The error for a parameter sharded over an axis the sync reduces over."""
  what = ("the data axis" if axis == data_axes[0] else
          "the local_axis (a second data axis inside a host, not a model axis)")
  return ValueError(
      f"{who}: parameter {name} is sharded over {what} {axis!r} ({spec}); the sync reduces "
      f"over that axis, so a parameter must be replicated over it and may be sharded over "
      f"the mesh's other axes {tuple(a for a in mesh_axes if a not in data_axes)} only.")


def local_shape(shape, spec: PartitionSpec, sizes: dict) -> tuple[int, ...]:
  """The shape of one device's shard of a leaf of ``shape`` sharded ``spec`` over a mesh
  whose axes have ``sizes``."""
  local = list(shape)
  for dim, entry in enumerate(spec):
    local[dim] //= math.prod(sizes[axis] for axis in axes_of(entry))
  return tuple(local)


def restrict(spec: PartitionSpec, axes) -> PartitionSpec:
  """``spec`` with only the mesh ``axes`` kept."""
  kept = []
  for entry in spec:
    names = tuple(a for a in axes_of(entry) if a in axes)
    kept.append(None if not names else names[0] if len(names) == 1 else names)
  while kept and kept[-1] is None:
    kept.pop()
  return PartitionSpec(*kept)
