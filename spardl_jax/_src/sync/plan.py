"""What one trace of a gradient sync fixes, built once: :class:`SyncPlan`.

A sync's ``init``, its ``update`` and the weight prediction's estimate all go from a tree of
this device's leaves to the flat vector its method syncs and back. The plan holds every
fact that mapping needs, fixed when the tree is traced: which leaves are floats (the sync
carries those; integer and boolean leaves pass through), which float leaves
``dense_leaves`` keeps out of the method, the promoted dtype, the :class:`Packing` of the
method's leaves on the mesh, the levels bound to those leaves and the devices ``p`` on the
data axis. Its methods are the mapping itself (:meth:`SyncPlan.vector`,
:meth:`SyncPlan.tree`), the method's fresh state and the state a device sees inside
``shard_map`` (:meth:`SyncPlan.fresh`, :meth:`SyncPlan.local`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spardl_jax._src.sync import levels as levels_
from spardl_jax._src.sync.packing import Packing, columns, is_synced
from spardl_jax._src.sync.settings import SyncOptions
from spardl_jax._src.sync.specs import leaf_specs
from spardl_jax._src.sync.sync_state import BuiltFor, SyncState

__all__ = ['GivenSpecs', 'NO_SPECS', 'SyncPlan', 'on_device', 'as_rows']


class GivenSpecs(NamedTuple):
  """Where a tree's leaves lie on the mesh, as the caller knows it: ``leaves``, every leaf's
  spec over the whole mesh (a list), or None where the caller has none; then ``params``,
  the parameters' specs a door passed, are read."""

  leaves: list | None = None
  params: Any = None


NO_SPECS = GivenSpecs()  # the caller knows none: the parameters are replicated off the data axes


def on_device(rows):
  """A tree of per-device rows (a leading axis of 1 inside ``shard_map``) as this device's
  values: the leading axis dropped."""
  return jax.tree.map(lambda a: a[0], rows)


def as_rows(tree):
  """This device's values as its rows: a leading axis of 1 added."""
  return jax.tree.map(lambda a: a[None], tree)


class SyncPlan(NamedTuple):
  """One trace's mapping between a tree of this device's leaves and its method's vector.

  Attributes:
    options: the sync's validated options.
    treedef: the tree's structure.
    synced: per leaf of the tree, whether the sync carries it (a float leaf).
    floats: the float leaves' shapes and dtypes, in order.
    dense: per float leaf, whether ``dense_leaves`` averages it outside the method.
    dtype: the promoted dtype of the float leaves, the vector's.
    packing: how the method's leaves make this device's vector (:class:`Packing`).
    levels: the sync's levels bound to the method's leaves and to ``p``.
    p: the devices on the data axis.
  """

  options: SyncOptions
  treedef: Any
  synced: tuple[bool, ...]
  floats: tuple[jax.ShapeDtypeStruct, ...]
  dense: tuple[bool, ...]
  dtype: Any
  packing: Packing
  levels: tuple[levels_.Level, ...]
  p: int

  @classmethod
  def build(cls, options: SyncOptions, tree, p: int,
            where: GivenSpecs = NO_SPECS) -> SyncPlan:
    """The plan of ``tree`` (this device's leaves, arrays or shapes) on ``p`` devices of the
    data axis, its leaves lying on the mesh as ``where`` says; a clear error where the tree
    has nothing to sync or its layout does not fit the method."""
    leaves, treedef = jax.tree.flatten(tree)
    synced = tuple(bool(is_synced(x)) for x in leaves)
    floats = tuple(jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
                   for x, s in zip(leaves, synced) if s)
    if not floats:
      raise ValueError("sync_gradients: the gradient pytree has no floating-point leaves to "
                       "synchronize.")
    dense = tuple(options.is_dense(x.shape) for x in floats)
    if options.dense_leaves is not None and all(dense):
      raise ValueError(f"sync_gradients: dense_leaves={options.dense_leaves!r} keeps every "
                       f"leaf dense, so {options.method!r} has nothing to sync; use "
                       f"method='dense', dense_leaves=None (every leaf through the method; "
                       f"synced_adamw's default is 'vectors'), or a rule that leaves some "
                       f"leaves to the method.")
    method = [x.shape for x, d in zip(floats, dense) if not d]
    packing = _packing(options, tree, synced, dense, method, where)
    bound = tuple(levels_.bind(list(options.levels), method, p))
    return cls(options, treedef, synced, floats, dense,
               jnp.result_type(*(x.dtype for x in floats)), packing, bound, p)

  @property
  def built_for(self) -> BuiltFor:
    """What a :class:`SyncState` of this plan records: the float leaves' shapes and the
    axes the sync reduces over."""
    return BuiltFor(tuple(x.shape for x in self.floats), self.options.data_axes)

  @property
  def n(self) -> int:
    """Entries of the vector the method syncs on this device."""
    return self.packing.n

  @property
  def sizes(self) -> tuple[int, ...]:
    """Entries of each leaf the method syncs, in order."""
    return tuple(math.prod(x.shape) for x, d in zip(self.floats, self.dense) if not d)

  @property
  def kept(self) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The float leaves ``dense_leaves`` keeps out of the method."""
    return tuple(x for x, d in zip(self.floats, self.dense) if d)

  def float_leaves(self, tree) -> list:
    """The float leaves of ``tree`` (of this plan's structure), in order."""
    return [x for x, s in zip(jax.tree.leaves(tree), self.synced) if s]

  def split(self, floats: list) -> tuple[list, list]:
    """``floats`` (one per float leaf) split into the method's and the dense ones."""
    return ([x for x, d in zip(floats, self.dense) if not d],
            [x for x, d in zip(floats, self.dense) if d])

  def vector(self, floats: list, dtype=None) -> tuple[jax.Array, list]:
    """``(x, kept)``: the method's ``(n,)`` vector of ``floats`` (a tree's float leaves, in
    ``dtype``, default :attr:`dtype`) and the dense leaves kept out of it."""
    method, kept = self.split(floats)
    return self.packing.flatten(method, dtype or self.dtype), kept

  def leaves(self, y: jax.Array, kept: list) -> list:
    """The float leaves, in order and in their dtypes, from the method's synced ``(n,)``
    vector ``y`` and the dense leaves ``kept``."""
    method = self.packing.unflatten(y, self.split(list(self.floats))[0])
    from_method, from_dense = iter(method), iter(kept)
    return [next(from_dense) if d else next(from_method) for d in self.dense]

  def tree(self, floats: list, like, other=lambda x: x):
    """The tree of ``like``'s structure with its float leaves replaced by ``floats`` (in
    order) and every other leaf by ``other(leaf)``."""
    out = iter(floats)
    return jax.tree.unflatten(self.treedef, [next(out) if s else other(x)
                                             for x, s in zip(jax.tree.leaves(like), self.synced)])

  def fresh(self):
    """The method's fresh per-device state for this vector. The last level's all-reduce owns
    it; every sparse level's must share its structure (checked on shapes, nothing
    allocated)."""
    init = [functools.partial(level.allreduce.init, n=self.n, dtype=self.dtype, p=self.p)
            for level in self.levels if not level.dense]
    if len({jax.tree.structure(jax.eval_shape(f)) for f in init}) > 1:
      raise ValueError(f"sync_gradients: the density levels of {self.options.method!r} keep "
                       f"states of different structures; use one density.")
    return self.levels[-1].allreduce.init(n=self.n, dtype=self.dtype, p=self.p)

  def level_starts(self) -> np.ndarray:
    """The step each level starts at, ascending."""
    return np.array([level.start for level in self.levels])

  def level_index(self, count) -> jax.Array:
    """The index of the level that sync ``count`` runs."""
    return (jnp.sum(count >= self.level_starts()) - 1).astype(jnp.int32)

  def balance_scales(self, x) -> jax.Array:
    """``balance="leaves"``: the power of two each entry of the method's vector ``x`` is
    scaled by before the method selects, the same for a whole leaf and on every device of
    the data axes: the one nearest to the ratio of the vector's root mean square to the
    leaf's, both over the devices' ``x`` (one all-reduce of two numbers a leaf). Under Adam
    every coordinate moves by about the learning rate whatever its gradient's size, and a
    leaf whose gradients are a tenth of the others' is starved by one top-k over the whole
    vector; scaled, each leaf competes at the same size. A power of two, so that scaling and
    unscaling are exact and the books stay exact; a leaf of zeros or non-finite values is
    not scaled (the guard skips the latter's step)."""
    sizes = self.sizes
    ids = self.packing.leaf_ids(sizes)
    count = len(sizes)
    squares = jax.ops.segment_sum(jnp.square(x.astype(jnp.float32)), ids, count + 1)
    entries = jax.ops.segment_sum(jnp.ones(x.shape, jnp.float32), ids, count + 1)
    totals = jax.lax.psum(jnp.stack([squares[:count], entries[:count]]),
                          self.options.data_axes)
    overall = jnp.sum(totals[0]) / jnp.sum(totals[1])
    ratio = 0.5 * jnp.log2(overall / (totals[0] / jnp.maximum(totals[1], 1.0)))
    limit = jnp.finfo(x.dtype).maxexp // 4  # room left for a residual larger than its leaf
    exponent = jnp.where(jnp.isfinite(ratio), jnp.clip(jnp.round(ratio), -limit, limit), 0.0)
    exponent = jnp.append(exponent.astype(jnp.int32), 0)  # the padding's
    # 2**e built from its bits: exact, where exp2 may round.
    scale = jax.lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32).astype(x.dtype)
    return scale[ids]

  def local(self, state):
    """``state`` as one device sees it inside ``shard_map``, checked to be this sync's for
    these leaves; returns the method's per-device state."""
    options = self.options
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
    if state.built_for.shapes != self.built_for.shapes:
      raise ValueError(f"sync_gradients: the gradients' float leaves have the shapes "
                       f"{self.built_for.shapes}, but the state was built for "
                       f"{state.built_for.shapes}; init with the same params (and "
                       f"param_specs).")
    if state.built_for != self.built_for:
      raise ValueError(f"sync_gradients: the state was built for a sync over "
                       f"{state.built_for.axes}, this one reduces over "
                       f"{self.built_for.axes}; init with this transformation.")
    local = on_device(state.method_state)
    expected = jax.eval_shape(self.fresh)
    # jaxlib ships PyTreeDef.__eq__ but no stub for it: the checker cannot see it.
    same = jax.tree.structure(local) == jax.tree.structure(expected)  # type: ignore[operator]
    if not same or any(a.shape != b.shape
                       for a, b in zip(jax.tree.leaves(local), jax.tree.leaves(expected))):
      raise ValueError(
          f"sync_gradients: the state does not fit {options.method!r} for {self.n} float "
          f"entries (it holds {type(local).__name__} with shapes "
          f"{[a.shape for a in jax.tree.leaves(local)]}); init it with this transformation "
          f"and the same params.")
    return local


def _packing(options: SyncOptions, tree, synced, dense, method_shapes,
             where: GivenSpecs) -> Packing:
  """How this device's method leaves of ``tree`` make its flat vector, the leaves lying on
  the mesh as ``where`` says."""
  others = columns(options.data_axes)
  specs = None
  if others:
    specs = where.leaves
    if specs is None:
      if where.params is None:
        raise ValueError(
            f"sync_gradients: the sync runs inside a shard_map over the mesh axes "
            f"{tuple(others)} besides {options.axis_name!r}, where each device holds only "
            f"its shards and the sync cannot see which parameters are replicated over those "
            f"axes; pass param_specs=<the parameters' PartitionSpecs> (the in_specs of your "
            f"shard_map) to the transformation.")
      specs = leaf_specs(tree, where.params)
    floats = [spec for spec, s in zip(specs, synced) if s]
    specs = [spec for spec, d in zip(floats, dense) if not d]
  packing = Packing.build(method_shapes, specs, others, options.local_axis)
  _check_leafwise(options, packing, tuple(others))
  return packing


def _check_leafwise(options: SyncOptions, packing: Packing, others) -> None:
  """A method that compresses each leaf as a matrix cannot take slices of the leaves."""
  if not any(level.allreduce.leafwise for level in options.levels):
    return
  if options.local_axis is not None:
    raise ValueError(f"sync_gradients: {options.method!r} compresses each parameter as a "
                     f"matrix, but local_axis={options.local_axis!r} syncs slices of the flat "
                     f"gradient; use a method that sees one flat vector (sj.methods.names()).")
  if packing.sliced:
    raise ValueError(
        f"sync_gradients: {options.method!r} compresses each parameter as a matrix, but some "
        f"parameters are replicated over the mesh axes {others}, whose slices the sync "
        f"spreads over those axes; shard every parameter over them, or use a method that "
        f"sees one flat vector (sj.methods.names()).")
