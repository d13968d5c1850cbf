"""How one device's gradient leaves make the flat vector it syncs, on a mesh of any shape.

The sync reduces over one data axis; the parameters may be sharded over the mesh's other
axes. Each device then syncs its own shards: the devices that share a position on the other
axes (a *column* of the data axis) run one all-reduce among them, over the data axis only, on
the concatenation of their local shards. No gradient is gathered over another axis.

A leaf replicated over some of the other axes holds the same shard on every device along
them; were each column to sync it inside its own vector, the columns' top-k selections
(which see different shards of the other leaves) would give its copies different updates and
the replicas would drift apart. So the leaves replicated over the same axes form a
:class:`LeafGroup`, each device along those axes syncs its 1/r slice of the group, and an
all-gather over those axes (the fast links inside a host, for a model axis) rebuilds the
whole on every device: every copy gets the same update and nothing is sent twice over the
data axis.

With a ``local_axis`` (a hierarchical sync) the vector is first reduced densely inside each
host (a reduce-scatter), each device syncs its 1/L slice across hosts, and the slices are
gathered back inside the host.

:class:`FlatLayout` is built once per trace, from the leaves' specs (:mod:`.specs`), and
cuts both ways: :meth:`FlatLayout.flatten` and :meth:`FlatLayout.unflatten`. Around it, the
rest of the tree <-> vector mapping: which leaves the sync carries (:func:`is_synced`) and
which of those ``dense_leaves`` keeps out of the method (:func:`split_leaves`), and the tree
put back together (:func:`merge_float_leaves`, :func:`with_float_leaves`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spardl_jax._src.core import flat as flat_vector
from spardl_jax._src.core.allreduce import axis_size, bound_axes
from spardl_jax._src.sync.specs import axes_of, leaf_specs

if TYPE_CHECKING:
  from spardl_jax._src.sync.settings import SyncOptions

__all__ = ['LeafGroup', 'FlatLayout', 'free_axes', 'columns', 'is_synced', 'synced_leaves',
           'LeafSpecs', 'NO_SPECS', 'Leaves', 'split_leaves', 'method_leaves',
           'merge_float_leaves', 'with_float_leaves']


def is_synced(x) -> bool:
  """Whether the sync carries the leaf ``x``: a floating-point array. Integer and boolean
  leaves (step counters, masks) pass through unsynced."""
  return jnp.issubdtype(x.dtype, jnp.floating)


def synced_leaves(tree) -> list:
  """The leaves of ``tree`` the sync carries (:func:`is_synced`), in order."""
  return [x for x in jax.tree.leaves(tree) if is_synced(x)]


class LeafGroup(NamedTuple):
  """Float leaves (indices among the float leaves) that are replicated over the same mesh
  ``axes`` besides the data axes (``()``: sharded over all of them, or a one-axis mesh)."""

  axes: tuple[str, ...]
  leaves: tuple[int, ...]
  size: int  # entries of the leaves' local shards together
  chunk: int  # entries of them this device syncs: size, or ceil(size / devices on axes)


def free_axes(axis_name: str) -> tuple[str, ...]:
  """Inside a ``shard_map`` that binds ``axis_name``: the mesh axes it left to the compiler
  (a partial-auto ``shard_map``), over which the sync opens one of its own to work on local
  shards; empty otherwise. Axes of size 1 count: a leaf typed as sharded over an ``Explicit``
  one cannot be reshaped into the flat vector outside such a ``shard_map``."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(getattr(mesh, "manual_axes", ()))
  if axis_name not in manual:
    return ()
  return tuple(a for a in mesh.axis_names if a not in manual)


def columns(data_axes: tuple[str, ...]) -> dict[str, int]:
  """The bound mesh axes of size > 1 besides ``data_axes``, with their sizes: the axes whose
  positions make a column of the data axis (empty on a one-axis mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  bound = set(bound_axes())
  return {a: mesh.shape[a] for a in mesh.axis_names
          if a in bound and a not in data_axes and mesh.shape[a] > 1}


class FlatLayout(NamedTuple):
  """How this device's float leaves make the vector its sync sees, and back.

  Attributes:
    groups: the leaf groups, in the order they are concatenated.
    local_axis: the axis reduced densely inside each host first, or None.
  """

  groups: tuple[LeafGroup, ...]
  local_axis: str | None = None

  @classmethod
  def build(cls, shapes, specs, others: dict[str, int],
            local_axis: str | None = None) -> "FlatLayout":
    """The layout of float leaves of these ``shapes`` with these ``specs`` over the mesh
    (None: a one-axis mesh, or no axis besides the data axes), ``others`` the column axes
    (:func:`columns`)."""
    if not others:
      size = sum(math.prod(s) for s in shapes)
      return cls((LeafGroup((), tuple(range(len(shapes))), size, size),), local_axis)
    by_axes: dict[tuple[str, ...], list[int]] = {}
    for i, spec in enumerate(specs):
      named = {a for entry in spec for a in axes_of(entry)}
      by_axes.setdefault(tuple(a for a in others if a not in named), []).append(i)
    groups = []
    for axes in sorted(by_axes, key=len):
      leaves = tuple(by_axes[axes])
      size = sum(math.prod(shapes[i]) for i in leaves)
      r = math.prod(others[a] for a in axes)
      groups.append(LeafGroup(axes, leaves, size, -(-size // r)))
    return cls(tuple(groups), local_axis)

  @property
  def sliced(self) -> bool:
    """Whether some leaves are synced in slices (replicated over a column axis)."""
    return any(group.axes for group in self.groups)

  @property
  def packed(self) -> int:
    """Entries of this device's vector before a ``local_axis`` reduce-scatter."""
    return sum(group.chunk for group in self.groups)

  @property
  def n(self) -> int:
    """Entries of the vector the method syncs on this device: the packed leaves, or with a
    ``local_axis`` its 1/L slice of them."""
    if self.local_axis is None:
      return self.packed
    return -(-self.packed // axis_size(self.local_axis, who="sync_gradients: local_axis"))

  def flatten(self, floats, dtype) -> jax.Array:
    """The ``(n,)`` vector the method syncs (inside ``shard_map`` over every axis of the
    groups): this device's float leaves in ``dtype``; with a ``local_axis``, its slice of
    the host's mean."""
    parts = []
    for group in self.groups:
      vec = flat_vector.concat([floats[i] for i in group.leaves], dtype)
      if group.axes:
        index = jax.lax.axis_index(group.axes)
        vec = jnp.pad(vec, (0, group.chunk * jax.lax.axis_size(group.axes) - group.size))
        vec = jax.lax.dynamic_slice(vec, (index * group.chunk,), (group.chunk,))
      parts.append(vec)
    vec = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    return vec if self.local_axis is None else _scatter_mean(vec, self.local_axis)

  def leaf_ids(self, sizes) -> jax.Array:
    """For each entry of the vector :meth:`flatten` makes on this device, the index of its
    leaf (among the leaves of ``sizes`` entries each, as ``flatten`` takes them), or
    ``len(sizes)`` for padding: worked out from the positions (a slice's start is this
    device's index on the group's axes), so no vector of ``n`` constants enters the
    program."""
    padding = len(sizes)
    parts = []
    for group in self.groups:
      ends = np.cumsum([sizes[i] for i in group.leaves])
      at = jnp.arange(group.chunk, dtype=jnp.int32)
      if group.axes:
        at = at + jax.lax.axis_index(group.axes) * group.chunk
      owner = jnp.asarray((*group.leaves, padding), jnp.int32)
      parts.append(owner[jnp.searchsorted(ends, at, side="right")])
    ids = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    if self.local_axis is None:
      return ids
    n = self.n  # this device's slice of the host's vector (_scatter_mean's)
    ids = jnp.pad(ids, (0, n * jax.lax.axis_size(self.local_axis) - ids.size),
                  constant_values=padding)
    return jax.lax.dynamic_slice(ids, (jax.lax.axis_index(self.local_axis) * n,), (n,))

  def unflatten(self, y: jax.Array, floats) -> list:
    """The synced ``(n,)`` vector ``y`` cut back into the float leaves, in their dtypes."""
    if self.local_axis is not None:
      y = _gather(y, self.local_axis, self.packed)
    out: list = [None] * len(floats)
    start = 0
    for group in self.groups:
      vec = y[start:start + group.chunk]
      start += group.chunk
      if group.axes:
        vec = _gather(vec, group.axes, group.size)
      for i, leaf in zip(group.leaves, flat_vector.split(vec, [floats[i] for i in group.leaves])):
        out[i] = leaf
    return out


def _scatter_mean(vec: jax.Array, axis: str) -> jax.Array:
  """This device's 1/L slice of the mean of ``vec`` over ``axis`` (L devices; ``vec``
  zero-padded to L equal slices): a dense reduce-scatter, the first stage of a hierarchical
  sync (the fast links inside a host)."""
  size = jax.lax.axis_size(axis)
  chunk = -(-vec.size // size)
  vec = jnp.pad(vec, (0, chunk * size - vec.size))
  return (jax.lax.psum_scatter(vec, axis, scatter_dimension=0, tiled=True) / size
          ).astype(vec.dtype)


def _gather(vec: jax.Array, axis: str | tuple[str, ...], size: int) -> jax.Array:
  """The slices of ``axis``'s devices put back together, the padding cut."""
  return jax.lax.all_gather(vec, axis, tiled=True)[:size]


# The tree <-> vector mapping of a sync: which leaves the method takes, and back.

class LeafSpecs(NamedTuple):
  """Where a tree's leaves lie on the mesh, as the caller knows it: ``leaves``, every leaf's
  spec over the whole mesh (a list), or None where the caller has none; then ``params``,
  the parameters' specs a door passed, are read."""

  leaves: list | None = None
  params: Any = None


NO_SPECS = LeafSpecs()  # the caller knows none: the parameters are replicated off the data axes


def _float_leaves(tree) -> tuple[list, Any]:
  leaves = synced_leaves(tree)
  if not leaves:
    raise ValueError("sync_gradients: the gradient pytree has no floating-point leaves to "
                     "synchronize.")
  return leaves, jnp.result_type(*(x.dtype for x in leaves))


def _dense_mask(options: SyncOptions, floats) -> list[bool]:
  """Which float leaves ``dense_leaves`` keeps dense; a clear error where it keeps all."""
  mask = [options.is_dense(tuple(x.shape)) for x in floats]
  if options.dense_leaves is not None and all(mask):
    raise ValueError(f"sync_gradients: dense_leaves={options.dense_leaves!r} keeps every "
                     f"leaf dense, so {options.method!r} has nothing to sync; use "
                     f"method='dense', dense_leaves=None (every leaf through the method; "
                     f"synced_adamw's default is 'vectors'), or a rule that leaves some "
                     f"leaves to the method.")
  return mask


def method_leaves(items: list, dense: list[bool]) -> list:
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


def split_leaves(options: SyncOptions, tree, where: LeafSpecs = NO_SPECS) -> Leaves:
  """``tree``'s float leaves split between the method and ``dense_leaves``, with the
  method's flat layout (:func:`_layout`)."""
  floats, dtype = _float_leaves(tree)
  dense = _dense_mask(options, floats)
  return Leaves(floats, dtype, dense, method_leaves(floats, dense),
                [x for x, d in zip(floats, dense) if d],
                _layout(options, tree, floats, dense, where))


def _layout(options: SyncOptions, tree, floats, dense, where: LeafSpecs) -> FlatLayout:
  """How this device's float leaves of ``tree`` (but those ``dense`` marks) make its flat
  vector, the leaves lying on the mesh as ``where`` says."""
  others = columns(options.data_axes)
  float_specs = None
  specs = where.leaves
  if others:
    if specs is None:
      if where.params is None:
        raise ValueError(
            f"sync_gradients: the sync runs inside a shard_map over the mesh axes "
            f"{tuple(others)} besides {options.axis_name!r}, where each device holds only "
            f"its shards and the sync cannot see which parameters are replicated over those "
            f"axes; pass param_specs=<the parameters' PartitionSpecs> (the in_specs of your "
            f"shard_map) to the transformation.")
      specs = leaf_specs(tree, where.params)
    float_specs = [spec for x, spec in zip(jax.tree.leaves(tree), specs) if is_synced(x)]
    float_specs = method_leaves(float_specs, dense)
  layout = FlatLayout.build([x.shape for x in method_leaves(floats, dense)], float_specs,
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


def merge_float_leaves(dense: list[bool], method_leaves, dense_leaves) -> list:
  """The float leaves in their order, from the method's and the dense ones (``dense`` marks
  which each is)."""
  from_method, from_dense = iter(method_leaves), iter(dense_leaves)
  return [next(from_dense) if d else next(from_method) for d in dense]


def with_float_leaves(treedef, leaves, floats, other=lambda x: x):
  """The tree of ``leaves`` with its float leaves replaced by ``floats`` (in order) and
  every other leaf by ``other(leaf)``."""
  out = iter(floats)
  return jax.tree.unflatten(treedef, [next(out) if is_synced(x)
                                      else other(x) for x in leaves])
