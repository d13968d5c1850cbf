"""Sharding the optimizer state of a data-parallel train step that syncs with SparDL.

In a ``jax.shard_map`` train step the parameters and most optimizer state are replicated
(``PartitionSpec()``), but some state is per device and must be stored with a device axis
sharded over the data axis, so that every device keeps (and a checkpoint saves) its own:

* every leaf of a :class:`~spardl_jax.sync.transform.SyncState` (the residual, ``(P, n)``
  globally, and the statistics, ``(P,)``);
* the accumulated gradients of an ``optax.MultiSteps`` that wraps a gradient sync: they are
  local gradients not synchronized yet, stored concatenated along their first axis (a
  parameter of shape ``(a, b)`` gives a ``(P * a, b)`` global array).

The rules are structural, so they are predictable and need no tracing.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from spardl_jax.core import protocol
from spardl_jax.sync.transform import SyncState

__all__ = ['fold_rules', 'opt_state_specs', 'opt_state_shardings', 'init_opt_state']


def _contains_sync(tree) -> bool:
  return any(isinstance(x, SyncState)
             for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, SyncState)))


def _specs(state, axis_name: str):
  per_device = PartitionSpec(axis_name)

  def spec(node):
    if isinstance(node, SyncState):
      return jax.tree.map(lambda _: per_device, node)
    if isinstance(node, optax.MultiStepsState) and _contains_sync(node.inner_opt_state):
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
          inner_opt_state=_specs(node.inner_opt_state, axis_name),
          acc_grads=jax.tree.map(lambda _: per_device, node.acc_grads),
          skip_state=jax.tree.map(lambda _: PartitionSpec(), node.skip_state))
    return PartitionSpec()

  return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(
      x, (SyncState, optax.MultiStepsState)))


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


def _local_state(tx: optax.GradientTransformation, params, mesh):
  """The state structure ``tx.init`` builds on one device (shapes and dtypes only)."""
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=PartitionSpec(),
                       out_specs=PartitionSpec(), check_vma=False)
  return jax.eval_shape(init, params)


def opt_state_specs(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh, *,
                    axis_name: str = "data"):
  """PartitionSpecs of ``tx``'s state for a data-parallel ``shard_map`` train step.

  Args:
    tx: the optimizer, containing :func:`spardl_jax.spardl` (or another sync) anywhere.
    params: the parameters, arrays or ``jax.ShapeDtypeStruct`` leaves.
    mesh: the mesh the train step runs on.
    axis_name: the data-parallel axis.

  Returns:
    A pytree of the state's structure: ``PartitionSpec(axis_name)`` for per-device leaves
    (see the module docstring), ``PartitionSpec()`` for the rest. Use it as the state's
    ``in_specs``/``out_specs`` in ``shard_map``.
  """
  return _specs(_local_state(tx, params, mesh), axis_name)


def opt_state_shardings(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh, *,
                        axis_name: str = "data"):
  """``NamedSharding`` s of ``tx``'s state (for ``jax.jit`` ``out_shardings`` or Orbax)."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                      opt_state_specs(tx, params, mesh, axis_name=axis_name))


def init_opt_state(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh, *,
                   axis_name: str = "data"):
  """``tx.init(params)`` created directly with its data-parallel shardings.

  Each device initializes its own slice inside ``shard_map``, so no ``(P, n)`` array is
  ever built on one device.

  Args:
    tx: the optimizer.
    params: the (replicated) parameters.
    mesh: the mesh of the train step.
    axis_name: the data-parallel axis.

  Returns:
    The optimizer state, per-device leaves sharded ``PartitionSpec(axis_name)``.
  """
  specs = opt_state_specs(tx, params, mesh, axis_name=axis_name)
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=PartitionSpec(), out_specs=specs,
                       check_vma=False)
  return jax.jit(init)(params)
