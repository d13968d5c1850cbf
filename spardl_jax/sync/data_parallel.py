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
  first axis (a parameter of shape ``(a, b)`` gives a ``(P * a, b)`` global array);
* a :class:`~spardl_jax.sync.outer.DiLoCoState`'s per-replica offsets and inner optimizer
  state: a leading axis over the data axis, the rest as the leaf would be stored alone (a
  parameter's offset ``(P, *shape)`` with ``PartitionSpec(axis_name, *its spec)``).

The rules are structural, so they are predictable and need no tracing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from spardl_jax.core import protocol
from spardl_jax.sync import mesh_axes
from spardl_jax.sync.outer import DiLoCoState, find_outer, replica_params
from spardl_jax.sync.transform import SyncState, states_in

__all__ = ['fold_rules', 'opt_state_specs', 'opt_state_shardings', 'init_opt_state',
           'data_parallel_step', 'sync_state_filter']


def _contains_sync(tree) -> bool:
  return bool(states_in(tree, SyncState))


def _specs(state, rows: PartitionSpec, params: dict | None):
  """``state``'s specs: ``rows`` for per-device leaves, the parameter's spec for a subtree
  shaped like the parameters (``params`` maps their structure and local shapes to their
  specs; None: replicated like the rest), ``PartitionSpec()`` for the rest."""
  def like_params(node) -> bool:
    return (params is not None
            and jax.tree.structure(node) == params["treedef"]  # type: ignore[operator]
            and [tuple(x.shape) for x in jax.tree.leaves(node)] == params["shapes"])

  def per_replica(tree):
    """Leaves with a leading axis over the data axis (its first axis in ``rows``)."""
    data = mesh_axes.axes_of(rows[0])[0]
    alone = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)
    return jax.tree.map(lambda spec: PartitionSpec(data, *spec), _specs(alone, rows, params),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))

  def spec(node):
    if isinstance(node, SyncState):
      return jax.tree.map(lambda _: rows, node)
    if isinstance(node, DiLoCoState):
      return DiLoCoState(PartitionSpec(), per_replica(node.offset), per_replica(node.inner),
                         _specs(node.sync, rows, params), _specs(node.outer, rows, params))
    if like_params(node):
      return jax.tree.unflatten(params["treedef"], params["specs"])
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
      x, (SyncState, DiLoCoState, optax.MultiStepsState)) or like_params(x))


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
  others = tuple(a for a in mesh.axis_names if a != axis_name and mesh.shape[a] > 1)
  if param_specs is None and not mesh_axes.layout_known(params, mesh, others):
    raise ValueError(
        f"{who}: the mesh axes {others} are Auto and some parameters carry no sharding "
        f"(traced, or not placed on the mesh), so their layout over those axes is unknown; "
        f"pass param_specs=<the parameters' PartitionSpecs>, or place the parameters first.")
  specs = mesh_axes.leaf_specs(params, param_specs)
  mesh_axes.check_leaf_specs(params, specs, dict(mesh.shape), axis_name, who)
  treedef = jax.tree.structure(params)
  local = []
  for x, spec in zip(jax.tree.leaves(params), specs):
    shape = list(x.shape)
    for dim, entry in enumerate(spec):
      for axis in mesh_axes.axes_of(entry):
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
  with mesh_axes.known_specs(spec_tree):
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
  with mesh_axes.known_specs(spec_tree):
    return jax.jit(init)(params)


def sync_state_filter(opt_state, *, prefix: tuple = ("opt_state",)):
  """A path filter that selects the sync's per-device leaves in a Flax NNX state.

  ``nnx.Optimizer(model, tx)`` keeps ``tx``'s state under ``opt_state``; in an
  ``nnx.shard_map`` over the data axis those leaves need ``PartitionSpec(axis_name)`` and
  the rest ``PartitionSpec()``: ``nnx.StateSharding({sj.sync_state_filter(
  optimizer.opt_state): P("data"), ...: P()})`` says so (docs/api.md, "Flax").

  Args:
    opt_state: the optax state (``optimizer.opt_state``), holding one or more
      :class:`~spardl_jax.SyncState`.
    prefix: the path of ``opt_state`` in the state the filter will see.

  Returns:
    ``filter(path, value) -> bool``, True for the leaves inside a ``SyncState``.
  """
  def key(k):
    for attr in ("idx", "key", "name"):
      if hasattr(k, attr):
        return getattr(k, attr)
    raise TypeError(f"sync_state_filter: unexpected path entry {k!r}")

  found = jax.tree_util.tree_flatten_with_path(
      opt_state, is_leaf=lambda x: isinstance(x, SyncState))[0]
  prefixes = [tuple(prefix) + tuple(key(k) for k in path) for path, node in found
              if isinstance(node, SyncState)]
  if not prefixes:
    raise ValueError("sync_state_filter: the optimizer state holds no SyncState (no "
                     "spardl_jax sync in the optimizer?).")

  def per_device(path, value) -> bool:
    del value
    return any(tuple(path[:len(p)]) == p for p in prefixes)

  return per_device


def data_parallel_step(loss_fn, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh, *,
                       axis_name: str = "data", local_axis: str | None = None,
                       has_aux: bool = False):
  """A jitted train step for ``jax.jit`` users: the gradient and its sync run per data shard
  (a partial-auto ``shard_map`` over ``axis_name``), everything else as the mesh shards it.

  Under plain ``jax.jit`` the gradient of a loss over the global batch is already the mean
  over the data axis, all-reduced densely by the compiler; compressing it needs each data
  shard's own gradient. This step computes ``jax.grad(loss_fn)`` on each data shard of the
  batch, with the parameters as they are (replicated, or sharded over the mesh's other axes
  by the compiler), syncs it with ``tx`` (which holds :func:`spardl_jax.spardl` or another
  sync over ``axis_name``), and applies the update. Only the sync crosses the data axis.

  Args:
    loss_fn: ``loss_fn(params, *batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``), the
      mean loss of the examples it is given.
    tx: the optimizer, a chain with the sync first.
    mesh: the mesh; the batch's leading dimension is sharded over ``axis_name``.
    axis_name: the data axis.
    local_axis: for a hierarchical sync (``tx`` built with the same ``local_axis``), the
      second data axis inside a host; the batch is then sharded over both.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

  Returns:
    ``step(params, opt_state, *batch) -> (params, opt_state, loss[, aux])``, jitted (the
    parameters' layout is read from the arrays, so it needs no ``param_specs``). ``loss``
    and the float leaves of ``aux`` are means over the data axis (the same on every device).
    ``opt_state`` comes from :func:`init_opt_state`.

  Example:

    >>> import jax, jax.numpy as jnp, optax, spardl_jax as sj
    >>> mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
    >>> tx = optax.chain(sj.spardl(density=0.1), optax.sgd(0.1))
    >>> params = {"w": jnp.zeros((8, 2))}
    >>> opt_state = sj.init_opt_state(tx, params, mesh)
    >>> step = sj.data_parallel_step(lambda p, x, y: jnp.mean((x @ p["w"] - y) ** 2), tx, mesh)
    >>> params, opt_state, loss = step(params, opt_state, jnp.ones((16, 8)), jnp.ones((16, 2)))
    >>> float(loss)
    1.0
  """
  mesh_axes.check_axis(mesh, axis_name, "data_parallel_step")
  data: tuple[str, ...] = (axis_name,)
  if local_axis is not None:
    mesh_axes.check_axis(mesh, local_axis, "data_parallel_step")
    data = (axis_name, local_axis)
  if not callable(loss_fn):
    raise TypeError(f"data_parallel_step: loss_fn must be callable, got {type(loss_fn).__name__}.")

  def agreed(tree):
    return jax.tree.map(lambda a: jax.lax.pmean(a, data)
                        if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating) else a, tree)

  def local(params, opt_state, batch):
    if local_axis is not None and find_outer(opt_state) is not None:
      raise ValueError(f"data_parallel_step: an outer loop (spardl_jax.diloco) runs one "
                       f"replica per device of {axis_name!r}; with local_axis="
                       f"{local_axis!r} the devices of a host would drift apart. Drop "
                       f"local_axis.")
    at = replica_params(opt_state, params)  # an outer loop's replica; else params
    out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(at, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, agreed(out)

  @jax.jit
  def jitted(params, opt_state, *batch):
    split = PartitionSpec(data if local_axis else axis_name)
    rows = _specs(opt_state, split, None)
    out = jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), rows, split),
                        out_specs=(PartitionSpec(), rows, PartitionSpec()),
                        axis_names=set(data), check_vma=False)(params, opt_state, batch)
    specs = mesh_axes.given_specs()
    if specs is not None:  # on Auto axes the compiler would pick the new layout; keep it
      out = (jax.tree.map(lambda p, spec: jax.lax.with_sharding_constraint(
          p, NamedSharding(mesh, spec)), out[0], specs,
          is_leaf=lambda x: isinstance(x, PartitionSpec)),) + out[1:]
    return out[:2] + (tuple(out[2]) if has_aux else (out[2],))

  others = tuple(a for a in mesh.axis_names if a not in data and mesh.shape[a] > 1)

  def layout(params):
    """The parameters' specs where the arrays carry them (placed arrays, or Explicit axes);
    None for ones traced on Auto axes (the sync then asks for ``param_specs``)."""
    if not mesh_axes.layout_known(params, mesh, others):
      return None
    return jax.tree.unflatten(jax.tree.structure(params), mesh_axes.leaf_specs(params))

  def step(params, opt_state, *batch):
    # The arrays' shardings are part of jit's cache key, so a step traced with these specs
    # is never reused for parameters laid out otherwise.
    with mesh_axes.known_specs(layout(params)):
      return jitted(params, opt_state, *batch)

  def lower(params, opt_state, *batch):
    with mesh_axes.known_specs(layout(params)):
      return jitted.lower(params, opt_state, *batch)

  step.lower = lower  # type: ignore[attr-defined]  # as a jitted function has, for the HLO
  return step
