"""How one device's gradient leaves make the flat vector it syncs, on a mesh of any shape.

The sync reduces over one data axis; the parameters may be sharded over the mesh's other
axes. Each device then syncs its own shards: the devices that share a position on the other
axes (a *column* of the data axis) run one all-reduce among them, over the data axis only, on
the concatenation of their local shards. No gradient is gathered over another axis.

A leaf replicated over some of the other axes holds the same shard on every device along
them; were each column to sync it inside its own vector, the columns' top-k selections
(which see different shards of the other leaves) would give its copies different updates and
the replicas would drift apart. So the leaves replicated over the same axes form a
:class:`SliceGroup`, each device along those axes syncs its 1/r slice of the group, and an
all-gather over those axes (the fast links inside a host, for a model axis) rebuilds the
whole on every device: every copy gets the same update and nothing is sent twice over the
data axis.

With a ``local_axis`` (a hierarchical sync) the vector is first reduced densely inside each
host (a reduce-scatter), each device syncs its 1/L slice across hosts, and the slices are
gathered back inside the host.

:class:`Packing` is built once per trace, from the leaves' specs (:mod:`.specs`), and cuts
both ways: :meth:`Packing.flatten` and :meth:`Packing.unflatten`. Which leaves the sync
carries (:func:`is_synced`) and the rest of the tree <-> vector mapping are the trace's plan
(:mod:`.plan`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spardl_jax._src.core import flat as flat_vector
from spardl_jax._src.core.allreduce import axis_size, bound_axes
from spardl_jax._src.sync.specs import axes_of

__all__ = ['SliceGroup', 'Packing', 'free_axes', 'columns', 'is_synced', 'synced_leaves',
           'replicas_over', 'replica_axes']


def is_synced(x) -> bool:
  """Whether the sync carries the leaf ``x``: a floating-point array. Integer and boolean
  leaves (step counters, masks) pass through unsynced."""
  return jnp.issubdtype(x.dtype, jnp.floating)


def synced_leaves(tree) -> list:
  """The leaves of ``tree`` the sync carries (:func:`is_synced`), in order."""
  return [x for x in jax.tree.leaves(tree) if is_synced(x)]


class SliceGroup(NamedTuple):
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


_REPLICAS: contextvars.ContextVar = contextvars.ContextVar("replicas_over",
                                                           default=())


@contextlib.contextmanager
def replicas_over(*axes: str):
  """A tracing context: the mesh ``axes`` hold independent replicas (an outer loop's
  islands), which a sync traced inside it leaves alone. An island's own sync then reduces
  over the island's data axis only, and nothing it sends, gathers or agrees on crosses the
  replicas' axis (it is no column axis of :func:`columns`)."""
  token = _REPLICAS.set(tuple(dict.fromkeys((*_REPLICAS.get(), *axes))))
  try:
    yield
  finally:
    _REPLICAS.reset(token)


def replica_axes() -> tuple[str, ...]:
  """The axes of the innermost :func:`replicas_over`, or ``()``."""
  return _REPLICAS.get()


def columns(data_axes: tuple[str, ...]) -> dict[str, int]:
  """The bound mesh axes of size > 1 besides ``data_axes`` and :func:`replica_axes`, with
  their sizes: the axes whose positions make a column of the data axis (empty on a one-axis
  mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  bound = set(bound_axes())
  apart = set(data_axes) | set(replica_axes())
  return {a: mesh.shape[a] for a in mesh.axis_names
          if a in bound and a not in apart and mesh.shape[a] > 1}


class Packing(NamedTuple):
  """How this device's float leaves make the vector its sync sees, and back.

  Attributes:
    groups: the leaf groups, in the order they are concatenated.
    local_axis: the axis reduced densely inside each host first, or None.
  """

  groups: tuple[SliceGroup, ...]
  local_axis: str | None = None

  @classmethod
  def build(cls, shapes, specs, others: dict[str, int],
            local_axis: str | None = None) -> "Packing":
    """The layout of float leaves of these ``shapes`` with these ``specs`` over the mesh
    (None: a one-axis mesh, or no axis besides the data axes), ``others`` the column axes
    (:func:`columns`)."""
    if not others:
      size = sum(math.prod(s) for s in shapes)
      return cls((SliceGroup((), tuple(range(len(shapes))), size, size),), local_axis)
    by_axes: dict[tuple[str, ...], list[int]] = {}
    for i, spec in enumerate(specs):
      named = {a for entry in spec for a in axes_of(entry)}
      by_axes.setdefault(tuple(a for a in others if a not in named), []).append(i)
    groups = []
    for axes in sorted(by_axes, key=len):
      leaves = tuple(by_axes[axes])
      size = sum(math.prod(shapes[i]) for i in leaves)
      r = math.prod(others[a] for a in axes)
      groups.append(SliceGroup(axes, leaves, size, -(-size // r)))
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
