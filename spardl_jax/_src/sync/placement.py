"""Where each leaf of an optimizer state lives on the mesh, and how it moves onto another
device count: one walk over what each state type declares (:func:`spardl_jax._src.core.protocol.layout`).

In a data-parallel train step most of the optimizer state follows the parameters (replicated,
or sharded over the mesh's other axes like the parameter it belongs to), but some is stored
per device so that every device keeps, and a checkpoint saves, its own:

* ``PER_DEVICE``: one row per device of the whole mesh, data-major: the leading axis is sharded
  ``PartitionSpec((axis_name, *others))`` (``PartitionSpec(axis_name)`` on a one-axis mesh).
  The sync's residuals, velocities and statistics (:class:`~spardl_jax.states.SyncState`).
* ``PER_REPLICA``: a leading axis over the data axis, the rest laid out as the leaf would be
  alone (a parameter's offset ``(P, *shape)`` with ``PartitionSpec(axis_name, *its spec)``):
  an outer loop's replicas (:class:`~spardl_jax.states.DiLoCoState`).
* ``LIKE_PARAMS``: shaped like the parameters, each leaf laid out as its parameter (momentum,
  Adam's moments). A state type may declare it (Adam's do; a field that is not so shaped is
  refused) or leave it to be recognised by shape (optax's own states);
* the rest replicated.

Each state type declares its fields once; :func:`places` walks a state by those declarations,
and the specs, the shardings, a sharded init and the fold rules of a checkpoint restore all read
that one walk. A new state type needs no edit here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec

from spardl_jax._src.core import protocol
from spardl_jax._src.core.protocol import FRESH, LIKE_PARAMS, PER_DEVICE, PER_REPLICA, REPLICATED
from spardl_jax._src.sync.specs import axes_of

__all__ = ['LIKE_PARAMS', 'device_axes', 'device_spec', 'ParamLayout', 'Place', 'places', 'holds',
           'state_specs', 'fold_rules']


def device_axes(axis_names, axis_name: str) -> tuple[str, ...]:
  """The mesh axes that index a per-device row: the data axis first, then the others."""
  return (axis_name, *(a for a in axis_names if a != axis_name))


def device_spec(axis_names, axis_name: str) -> PartitionSpec:
  """The spec of a per-device leaf's leading axis on a mesh with these ``axis_names``."""
  axes = device_axes(axis_names, axis_name)
  return PartitionSpec(axes if len(axes) > 1 else axis_name)


class ParamLayout(NamedTuple):
  """The parameters as one device holds them: their structure, each leaf's spec over the
  mesh and its local shard's shape (what state shaped like the parameters looks like
  inside ``shard_map``)."""

  treedef: Any
  specs: tuple[PartitionSpec, ...]
  local_shapes: tuple[tuple[int, ...], ...]

  def matches(self, node) -> bool:
    """Whether ``node`` is shaped like the parameters' local shards."""
    # jaxlib ships PyTreeDef.__eq__ but no stub for it: the checker cannot see it.
    return (jax.tree.structure(node) == self.treedef  # type: ignore[operator]
            and tuple(tuple(x.shape) for x in jax.tree.leaves(node)) == self.local_shapes)

  def spec_tree(self):
    return jax.tree.unflatten(self.treedef, self.specs)


class Place(NamedTuple):
  """Where one state leaf lives: ``where`` (``PER_DEVICE``, ``PER_REPLICA``, ``REPLICATED``
  or :data:`LIKE_PARAMS`), its ``fold`` rule, and ``spec``, the parameter's spec of a leaf
  laid out like one (under the replica axis for ``PER_REPLICA``; ``PartitionSpec()`` if
  none)."""

  where: str
  fold: str
  spec: PartitionSpec = PartitionSpec()

  def partition(self, rows: PartitionSpec) -> PartitionSpec:
    """This leaf's spec, with per-device rows laid out ``rows``."""
    if self.where == PER_DEVICE:
      return rows
    if self.where == PER_REPLICA:
      return PartitionSpec(axes_of(rows[0])[0], *self.spec)
    return self.spec


def _is_place(x) -> bool:
  return isinstance(x, Place)


def places(tree, *, params: ParamLayout | None = None, rows: PartitionSpec | None = None,
           fold: str = FRESH):
  """A pytree of ``tree``'s structure with a :class:`Place` per leaf.

  ``params`` recognises subtrees shaped like the parameters (None: none is); ``rows`` is the
  per-device rows' spec, which a state type declared by a function may check (None: no
  mesh, as for fold rules); ``fold`` is the rule of leaves no declaration covers."""
  def walk(node, where: str | None, rule: str):
    fields = protocol.declared_fields(node, rows)
    if fields is not None:  # a declared state: each field as it says, or as its parent
      declared = [fields.get(name, protocol.Field()) for name in node._fields]
      return type(node)(*(walk(child, field.place or where, field.fold or rule)
                          for field, child in zip(declared, node)))
    if where == PER_REPLICA:  # laid out as the leaves would be alone, under the replica axis
      alone = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), node)
      # A state that declares its own rows per device (an island's sync) keeps them.
      return jax.tree.map(lambda place: place if place.where == PER_DEVICE
                          else Place(PER_REPLICA, place.fold, place.spec),
                          walk(alone, None, rule), is_leaf=_is_place)
    if (where == LIKE_PARAMS and params is not None and jax.tree.leaves(node)
        and not params.matches(node)):  # an empty field (None) holds nothing to lay out
      raise ValueError(f"spardl_jax: a state field declared like the parameters holds "
                       f"{jax.tree.structure(node)} with shapes "
                       f"{[tuple(x.shape) for x in jax.tree.leaves(node)]}, not the "
                       f"parameters' local shapes {params.local_shapes}.")
    if where in (None, LIKE_PARAMS) and params is not None and params.matches(node):
      return jax.tree.unflatten(params.treedef,
                                [Place(LIKE_PARAMS, rule, spec) for spec in params.specs])
    leaves = jax.tree.leaves(node)
    if len(leaves) == 1 and leaves[0] is node:
      return Place(where or REPLICATED, rule)
    # One level down (every child taken as a leaf), so that declared states and subtrees
    # shaped like the parameters are met wherever they sit.
    return jax.tree.map(lambda child: walk(child, where, rule), node,
                        is_leaf=lambda x: x is not node)

  return walk(tree, None, fold)


def holds(tree, where: str) -> bool:
  """Whether any leaf of ``tree`` (an optimizer state) lives ``where`` (e.g. ``PER_REPLICA``:
  an outer loop's replicas)."""
  return any(place.where == where
             for place in jax.tree.leaves(places(tree), is_leaf=_is_place))


def state_specs(tree, rows: PartitionSpec, params: ParamLayout | None = None):
  """``PartitionSpec`` s of an optimizer state: ``rows`` for per-device leaves, the data
  axis then the rest for per-replica ones, the parameters' specs for subtrees shaped like
  them, ``PartitionSpec()`` for the rest (see the module's docstring)."""
  return jax.tree.map(lambda place: place.partition(rows),
                      places(tree, params=params, rows=rows), is_leaf=_is_place)


def fold_rules(tree, rule: str = FRESH):
  """How each leaf of ``tree`` (a train state, an optimizer state) moves onto another number
  of devices: a pytree of ``tree``'s structure holding, per leaf, one of
  :data:`~spardl_jax._src.core.protocol.SUM` (per-device sums of gradient mass: residuals and
  velocities), ``SAME`` (equal on every device: the sync's step count), ``MEAN`` (the
  gradients an ``optax.MultiSteps`` accumulated, an outer loop's offsets) or ``FRESH``
  (restarted, e.g. a controller that depends on the device count). Each state type declares
  its fields' rules (:func:`spardl_jax._src.core.protocol.layout`); a rule covers its field's
  whole subtree unless a state inside declares its own (the method state in a SyncState,
  for example). ``rule`` is the rule of leaves no declaration covers."""
  return jax.tree.map(lambda place: place.fold, places(tree, fold=rule), is_leaf=_is_place)
