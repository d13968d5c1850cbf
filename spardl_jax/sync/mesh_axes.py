"""Where a gradient sync runs on a mesh of several axes (data parallelism beside FSDP or
tensor parallelism).

The sync reduces over one data axis, ``axis_name``; the parameters may be sharded over the
mesh's other axes. Each device then syncs its own shards: the devices that share a position on
the other axes (a *column* of the data axis) run one all-reduce among them, over the data axis
only, on the concatenation of their local shards. No gradient is gathered over another axis.

The sync's per-device state (residuals, velocities, statistics) has one row per device of the
whole mesh, data-major: its leading axis is sharded ``PartitionSpec((axis_name, *others))``
(``PartitionSpec(axis_name)`` on a one-axis mesh), so every device keeps its own column's books.

Inside a partial-auto ``jax.shard_map(..., axis_names={axis_name})`` the other axes are left to
the compiler; the sync opens a ``shard_map`` over them itself, so it still works on local shards
(:func:`on_local_shards`). It reads each leaf's sharding from its type where the mesh axes are
``Explicit``, from the concrete array's ``sharding``, or from the ``param_specs`` given.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from spardl_jax.core import flat as flat_vector

__all__ = ['device_axes', 'device_spec', 'check_axis', 'leaf_specs', 'layout_known', 'axes_of',
           'check_leaf_specs',
           'restrict', 'unbound_axes', 'on_local_shards', 'Segment', 'segments', 'pack',
           'unpack', 'scatter_mean', 'gather', 'known_specs', 'given_specs']


def device_axes(axis_names, axis_name: str) -> tuple[str, ...]:
  """The mesh axes that index a per-device row: the data axis first, then the others."""
  return (axis_name, *(a for a in axis_names if a != axis_name))


def device_spec(axis_names, axis_name: str) -> PartitionSpec:
  """The spec of a per-device leaf's leading axis on a mesh with these ``axis_names``."""
  axes = device_axes(axis_names, axis_name)
  return PartitionSpec(axes if len(axes) > 1 else axis_name)


def check_axis(mesh, axis_name, who: str) -> None:
  if not isinstance(axis_name, str) or axis_name not in mesh.axis_names:
    raise ValueError(f"{who}: axis_name={axis_name!r} is not an axis of the mesh; its axes "
                     f"are {tuple(mesh.axis_names)}.")


def _is_spec(x) -> bool:
  return x is None or isinstance(x, PartitionSpec)


def leaf_specs(tree, param_specs=None) -> list[PartitionSpec]:
  """One ``PartitionSpec`` per leaf of ``tree``: from ``param_specs`` (a pytree of specs of
  ``tree``'s structure, ``None`` for replicated) when given, else the leaf's own sharding (a
  concrete array's ``NamedSharding``, a ``jax.ShapeDtypeStruct``'s, or its type's under
  ``Explicit`` mesh axes), else replicated."""
  leaves = jax.tree.leaves(tree)
  if param_specs is not None:
    specs = jax.tree.leaves(param_specs, is_leaf=_is_spec)
    if len(specs) != len(leaves):
      raise ValueError(f"param_specs has {len(specs)} entries, but the parameters have "
                       f"{len(leaves)} leaves; give one PartitionSpec (or None) per leaf.")
    return [PartitionSpec() if s is None else s for s in specs]
  out = []
  for x in leaves:
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
      try:
        sharding = jax.typeof(x).sharding
      except (TypeError, AttributeError):  # a Python scalar or an unsharded stand-in
        sharding = None
    out.append(sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec())
  return out


def layout_known(tree, mesh, axes) -> bool:
  """Whether the leaves of ``tree`` show their layout over the mesh ``axes`` without
  ``param_specs``: those axes are ``Explicit`` (a traced value's type then names them), or
  every leaf is placed (an array or ``jax.ShapeDtypeStruct`` with a ``NamedSharding``). A
  value traced on ``Auto`` axes shows none: its type says replicated, whatever it is."""
  explicit = all(mesh.axis_types[mesh.axis_names.index(a)] == jax.sharding.AxisType.Explicit
                 for a in axes)
  return explicit or all(isinstance(getattr(x, "sharding", None), NamedSharding)
                         for x in jax.tree.leaves(tree))


def axes_of(entry) -> tuple:
  """The mesh axes one entry of a ``PartitionSpec`` names: ``()`` for None, a tuple for
  several (Orbax's metadata writes them as a list)."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def check_leaf_specs(tree, specs, shape: dict, axis_name, who: str) -> None:
  """Clear errors for a leaf sharded over the data axis (``axis_name``: one, or a tuple of
  the data axes) or over an axis that does not divide it (``shape`` maps mesh axes to
  sizes)."""
  data_axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  for path, x, spec in zip(paths, jax.tree.leaves(tree), specs):
    for dim, entry in enumerate(spec):
      for axis in axes_of(entry):
        if axis in data_axes:
          raise ValueError(
              f"{who}: parameter {path or 'params'} is sharded over the data axis "
              f"{axis!r} ({spec}); the sync reduces over that axis, so a parameter must "
              f"be replicated over it and may be sharded over the mesh's other axes "
              f"{tuple(a for a in shape if a not in data_axes)} only.")
        if axis not in shape:
          raise ValueError(f"{who}: parameter {path or 'params'} names the axis {axis!r}, "
                           f"which is not in the mesh {tuple(shape)}.")
      size = 1
      for axis in axes_of(entry):
        size *= shape[axis]
      if dim >= len(x.shape):
        raise ValueError(f"{who}: parameter {path or 'params'} of shape {tuple(x.shape)} "
                         f"cannot be sharded {spec}: it has no dimension {dim}.")
      if x.shape[dim] % size:
        raise ValueError(
            f"{who}: parameter {path or 'params'} of shape {tuple(x.shape)} cannot be sharded "
            f"{spec}: dimension {dim} must be divisible by {size} (the mesh axes "
            f"{axes_of(entry)}).")


def restrict(spec: PartitionSpec, axes) -> PartitionSpec:
  """``spec`` with only the mesh ``axes`` kept."""
  kept = []
  for entry in spec:
    names = tuple(a for a in axes_of(entry) if a in axes)
    kept.append(None if not names else names[0] if len(names) == 1 else names)
  while kept and kept[-1] is None:
    kept.pop()
  return PartitionSpec(*kept)


def unbound_axes(axis_name: str) -> tuple[str, ...]:
  """Inside a ``shard_map`` that binds ``axis_name``: the mesh axes of size > 1 it left to
  the compiler (a partial-auto ``shard_map``); empty otherwise."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(getattr(mesh, "manual_axes", ()))
  if axis_name not in manual:
    return ()
  return tuple(a for a in mesh.axis_names if a not in manual and mesh.shape[a] > 1)


def on_local_shards(fn, axes: tuple[str, ...], arg_specs, out_specs):
  """``fn`` run on each device's local shards, in a ``shard_map`` over the mesh ``axes``
  (those a partial-auto ``shard_map`` left to the compiler, or all of them outside one)."""
  return jax.shard_map(fn, in_specs=arg_specs, out_specs=out_specs, axis_names=set(axes),
                       check_vma=False)


class Segment(NamedTuple):
  """Float leaves (indices among the float leaves) that are replicated over the same mesh
  ``axes`` besides the data axis (``()``: sharded over all of them, or a one-axis mesh)."""

  axes: tuple[str, ...]
  leaves: tuple[int, ...]
  size: int  # entries of the leaves' local shards together
  chunk: int  # entries of them this device syncs: size, or ceil(size / devices on axes)


def segments(shapes, specs, others: dict[str, int]) -> tuple[Segment, ...]:
  """How one device's float leaves make the flat vector it syncs.

  A leaf replicated over some of the mesh's other axes ``others`` (sizes by name) holds the
  same shard on every device along them; were each column to sync it inside its own vector,
  the columns' top-k selections (which see different shards of the other leaves) would give
  its copies different updates, and the replicas would drift apart. So the leaves replicated
  over the same axes are concatenated, each device along those axes syncs its 1/r slice of
  them (zero-padded to r equal slices), and an all-gather over those axes (the fast links
  inside a host, for a model axis) rebuilds the whole on every device: every copy gets the
  same update and nothing is sent twice over the data axis.
  """
  groups: dict[tuple[str, ...], list[int]] = {}
  for i, spec in enumerate(specs):
    named = {a for entry in spec for a in axes_of(entry)}
    groups.setdefault(tuple(a for a in others if a not in named), []).append(i)
  out = []
  for axes in sorted(groups, key=len):
    leaves = tuple(groups[axes])
    size = sum(math.prod(shapes[i]) for i in leaves)
    r = math.prod(others[a] for a in axes)
    out.append(Segment(axes, leaves, size, -(-size // r)))
  return tuple(out)


def pack(floats, dtype, layout: tuple[Segment, ...]) -> jax.Array:
  """The flat vector this device syncs (inside ``shard_map`` over every axis of ``layout``)."""
  parts = []
  for seg in layout:
    vec = flat_vector.concat([floats[i] for i in seg.leaves], dtype)
    if seg.axes:
      index = jax.lax.axis_index(seg.axes)
      vec = jnp.pad(vec, (0, seg.chunk * jax.lax.axis_size(seg.axes) - seg.size))
      vec = jax.lax.dynamic_slice(vec, (index * seg.chunk,), (seg.chunk,))
    parts.append(vec)
  return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def unpack(y, floats, layout: tuple[Segment, ...]) -> list:
  """The synced flat vector ``y`` cut back into the float leaves, in their dtypes."""
  out: list = [None] * len(floats)
  start = 0
  for seg in layout:
    vec = y[start:start + seg.chunk]
    start += seg.chunk
    if seg.axes:
      vec = gather(vec, seg.axes, seg.size)
    offset = 0
    for i in seg.leaves:
      x = floats[i]
      out[i] = vec[offset:offset + x.size].reshape(x.shape).astype(x.dtype)
      offset += x.size
  return out


def scatter_mean(vec: jax.Array, axis: str) -> jax.Array:
  """This device's 1/L slice of the mean of ``vec`` over ``axis`` (L devices; ``vec``
  zero-padded to L equal slices): a dense reduce-scatter, the first stage of a hierarchical
  sync (the fast links inside a host)."""
  size = jax.lax.axis_size(axis)
  chunk = -(-vec.size // size)
  vec = jnp.pad(vec, (0, chunk * size - vec.size))
  return (jax.lax.psum_scatter(vec, axis, scatter_dimension=0, tiled=True) / size
          ).astype(vec.dtype)


def gather(vec: jax.Array, axis: str | tuple[str, ...], size: int) -> jax.Array:
  """The slices of ``axis``'s devices put back together, the padding cut: the last stage of
  a hierarchical sync."""
  return jax.lax.all_gather(vec, axis, tiled=True)[:size]


_KNOWN_SPECS: contextvars.ContextVar = contextvars.ContextVar("known_specs", default=None)


@contextlib.contextmanager
def known_specs(param_specs):
  """While tracing a step or ``tx.init`` that this library wraps in a ``shard_map``, tells
  the syncs inside the parameters' specs (a pytree of the parameters' structure): the
  wrappers know them from the arrays, where the sync sees only local shards (a
  ``shard_map`` over every axis) or ``Auto`` axes that do not say."""
  token = _KNOWN_SPECS.set(param_specs)
  try:
    yield
  finally:
    _KNOWN_SPECS.reset(token)


def given_specs():
  """The specs :func:`known_specs` set, or None."""
  return _KNOWN_SPECS.get()
