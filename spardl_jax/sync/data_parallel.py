"""Sharding the optimizer state of a data-parallel train step that syncs gradients.

In a ``jax.shard_map`` train step the optimizer state follows the parameters (replicated, or
sharded over the mesh's other axes like the parameter it belongs to), but some state is per
device and is stored with a device axis, so that every device keeps (and a checkpoint saves)
its own:

* every leaf of a :class:`~spardl_jax.sync.transform.SyncState` (the residual, ``(P, n)``
  globally on a one-axis mesh, and the statistics, ``(P,)``); on a mesh of several axes one
  row per device of the mesh, data-major (:mod:`spardl_jax.sync.mesh_axes`);
* the accumulated gradients of an ``optax.MultiSteps`` that wraps a gradient sync (one-axis
  meshes only): they are local gradients not synchronized yet, stored concatenated along their
  first axis (a parameter of shape ``(a, b)`` gives a ``(P * a, b)`` global array).

The rules are structural, so they are predictable and need no tracing.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from spardl_jax.core import protocol
from spardl_jax.sync import mesh_axes
from spardl_jax.sync.transform import SyncState

__all__ = ['fold_rules', 'opt_state_specs', 'opt_state_shardings', 'init_opt_state']


def _contains_sync(tree) -> bool:
  return any(isinstance(x, SyncState)
             for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, SyncState)))


def _specs(state, rows: PartitionSpec, params: dict):
  """``state``'s specs: ``rows`` for per-device leaves, the parameter's spec for a subtree
  shaped like the parameters (``params`` maps their structure and local shapes to their
  specs), ``PartitionSpec()`` for the rest."""
  treedef, shapes, specs = params["treedef"], params["shapes"], params["specs"]

  def like_params(node) -> bool:
    return (jax.tree.structure(node) == treedef  # type: ignore[operator]
            and [tuple(x.shape) for x in jax.tree.leaves(node)] == shapes)

  def spec(node):
    if isinstance(node, SyncState):
      return jax.tree.map(lambda _: rows, node)
    if like_params(node):
      return jax.tree.unflatten(treedef, specs)
    if isinstance(node, optax.MultiStepsState) and _contains_sync(node.inner_opt_state):
      if rows != PartitionSpec(rows[0]) or isinstance(rows[0], tuple):
        raise ValueError(
            "opt_state_specs: optax.MultiSteps around a gradient sync is supported on a "
            "one-axis mesh only; on a mesh of several axes accumulate the gradients before "
            "the sync in the train step instead.")
      if jax.tree.leaves(node.skip_state):
        raise ValueError(
            "opt_state_specs: optax.MultiSteps around a gradient sync has a "
            "should_skip_update_fn (such as optax.skip_not_finite). It decides on each "
            "device's own gradient whether to run the micro-step, so a device with a NaN "
            "would skip the collectives the others wait in (a hang). Drop it: the sync's "
            "nonfinite='skip' (the default) skips a bad step on every device alike.")
      for leaf in jax.tree.leaves(node.acc_grads):
        if not leaf.shape:
          raise ValueError(
              "opt_state_specs: optax.MultiSteps around a gradient sync accumulates local "
              "gradients per device, along their first axis; a 0-d parameter has none. "
              "Reshape scalar parameters to shape (1,).")
      return node._replace(
          mini_step=PartitionSpec(), gradient_step=PartitionSpec(),
          inner_opt_state=_specs(node.inner_opt_state, rows, params),
          acc_grads=jax.tree.map(lambda _: rows, node.acc_grads),
          skip_state=jax.tree.map(lambda _: PartitionSpec(), node.skip_state))
    return PartitionSpec()

  return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(
      x, (SyncState, optax.MultiStepsState)) or like_params(x))


# optax's own state type whose per-device leaves are ours to fold.
protocol.folds(acc_grads=protocol.MEAN)(optax.MultiStepsState)


def _declares(node) -> bool:
  return protocol.declared_folds(type(node)) is not None


def fold_rules(tree, rule: str = protocol.FRESH):
  """How each leaf of ``tree`` (a train state, an optimizer state) moves onto another number
  of devices: a pytree of ``tree``'s structure holding, per leaf, one of
  :data:`~spardl_jax.core.protocol.SUM` (per-device sums of gradient mass: residuals and
  velocities), ``SAME`` (equal on every device: the sync's step count), ``MEAN`` (the
  gradients an ``optax.MultiSteps`` accumulated) or ``FRESH`` (restarted, e.g. a controller
  that depends on the device count). Each state type declares its fields' rules with
  :func:`spardl_jax.core.protocol.folds`; a rule covers its field's whole subtree unless a
  state inside declares its own (the method state in a SyncState, for example)."""
  def one(node):
    if not _declares(node):
      return rule
    fold = protocol.declared_folds(type(node)) or {}
    return type(node)(*(fold_rules(child, fold.get(field, rule))
                        for field, child in zip(node._fields, node)))

  return jax.tree.map(one, tree, is_leaf=_declares)


def _layout(params, mesh, axis_name: str, param_specs, who: str):
  """The parameters' specs over the mesh, checked, and what :func:`_specs` needs of them."""
  mesh_axes.check_axis(mesh, axis_name, who)
  specs = mesh_axes.leaf_specs(params, param_specs)
  mesh_axes.check_leaf_specs(params, specs, dict(mesh.shape), axis_name, who)
  treedef = jax.tree.structure(params)
  local = []
  for x, spec in zip(jax.tree.leaves(params), specs):
    shape = list(x.shape)
    for dim, entry in enumerate(spec):
      for axis in (entry if isinstance(entry, tuple) else () if entry is None else (entry,)):
        shape[dim] //= mesh.shape[axis]
    local.append(tuple(shape))
  return jax.tree.unflatten(treedef, specs), {"treedef": treedef, "shapes": local,
                                               "specs": specs}


def _local_state(tx: optax.GradientTransformation, params, mesh, spec_tree):
  """The state structure ``tx.init`` builds on one device (shapes and dtypes only)."""
  abstract = jax.tree.map(
      lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                           sharding=NamedSharding(mesh, spec)),
      params, spec_tree)
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=(spec_tree,), out_specs=PartitionSpec(),
                       check_vma=False)
  with mesh_axes.specs_for_init(spec_tree):
    return jax.eval_shape(init, abstract)


def opt_state_specs(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh, *,
                    axis_name: str = "data", param_specs=None, axis_names=None):
  """PartitionSpecs of ``tx``'s state for a data-parallel ``shard_map`` train step.

  Args:
    tx: the optimizer, containing :func:`spardl_jax.spardl` (or another sync) anywhere.
    params: the parameters: arrays or ``jax.ShapeDtypeStruct`` leaves, replicated or sharded
      over the mesh's axes other than ``axis_name`` (their shardings are read from them).
    mesh: the mesh the train step runs on (one axis, or several).
    axis_name: the data-parallel axis.
    param_specs: the parameters' ``PartitionSpec`` s (a pytree of their structure), where
      the leaves carry none.
    axis_names: the manual axes of the ``shard_map`` the specs are for (a partial-auto one
      over ``{axis_name}``, say); all the mesh's axes by default.

  Returns:
    A pytree of the state's structure: for the sync's per-device leaves the device axis
    (``PartitionSpec(axis_name)`` on a one-axis mesh, ``PartitionSpec((axis_name, *others))``
    on a larger one); for state shaped like the parameters (momentum, Adam's moments) the
    parameter's spec; ``PartitionSpec()`` for the rest. Use it as the state's
    ``in_specs``/``out_specs`` in ``shard_map``.

  Raises:
    ValueError: ``axis_name`` is not a mesh axis, a parameter is sharded over it, or a mesh
      axis does not divide the dimension it shards.
  """
  spec_tree, layout = _layout(params, mesh, axis_name, param_specs, "opt_state_specs")
  rows = mesh_axes.device_spec(mesh.axis_names, axis_name)
  specs = _specs(_local_state(tx, params, mesh, spec_tree), rows, layout)
  if axis_names is None:
    return specs
  return jax.tree.map(lambda spec: mesh_axes.restrict(spec, set(axis_names)), specs,
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def opt_state_shardings(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh, *,
                        axis_name: str = "data", param_specs=None):
  """``NamedSharding`` s of ``tx``'s state (for ``jax.jit`` ``out_shardings`` or Orbax)."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                      opt_state_specs(tx, params, mesh, axis_name=axis_name,
                                      param_specs=param_specs),
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def init_opt_state(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh, *,
                   axis_name: str = "data", param_specs=None):
  """``tx.init(params)`` created directly with its shardings.

  Each device initializes its own slice inside ``shard_map``, so no ``(P, n)`` array is
  ever built on one device.

  Args:
    tx: the optimizer.
    params: the parameters, replicated or sharded over the mesh's other axes.
    mesh: the mesh of the train step.
    axis_name: the data-parallel axis.
    param_specs: the parameters' ``PartitionSpec`` s, where the arrays carry none.

  Returns:
    The optimizer state, sharded by :func:`opt_state_specs`.
  """
  spec_tree, _ = _layout(params, mesh, axis_name, param_specs, "init_opt_state")
  specs = opt_state_specs(tx, params, mesh, axis_name=axis_name, param_specs=param_specs)
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=(spec_tree,), out_specs=specs,
                       check_vma=False)
  with mesh_axes.specs_for_init(spec_tree):
    return jax.jit(init)(params)
