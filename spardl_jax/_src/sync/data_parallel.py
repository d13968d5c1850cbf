"""The optimizer state of a data-parallel train step that syncs gradients, laid out on the
mesh, and a jitted train step for ``jax.jit`` users.

Where each state leaf lives (per device, per replica, like the parameters, replicated) is
what its state type declares (:mod:`spardl_jax._src.sync.placement`); these functions read the
parameters' specs once (:mod:`spardl_jax._src.sync.specs`), trace ``tx.init`` on one device to
learn the state's structure, and lay it out. Every state type, ours and optax's, is handled
by that one walk.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from spardl_jax._src.core.protocol import PER_REPLICA
from spardl_jax._src.parallel.dispatch import bounded_dispatch
from spardl_jax._src.sync.packing import synced_leaves
from spardl_jax._src.sync.placement import ParamLayout, device_spec, holds, state_specs
from spardl_jax._src.sync.moves import gradient_point
from spardl_jax._src.sync.specs import (check_axis, check_leaf_specs, leaf_specs, local_shape,
                                   restrict, specs_shown, use_param_specs)
from spardl_jax._src.sync.sync_state import SyncState, states_in

__all__ = ['opt_state_specs', 'opt_state_shardings', 'init_opt_state', 'data_parallel_step',
           'sync_state_filter']


def _param_layout(params, mesh, axis_name: str, param_specs, who: str) -> ParamLayout:
  """The parameters' specs over the mesh, checked, with their local shards' shapes."""
  check_axis(mesh, axis_name, who)
  others = tuple(a for a in mesh.axis_names if a != axis_name and mesh.shape[a] > 1)
  if param_specs is None and not specs_shown(params, mesh, others):
    raise ValueError(
        f"{who}: the mesh axes {others} are Auto and some parameters carry no sharding "
        f"(traced, or not placed on the mesh), so their layout over those axes is unknown; "
        f"pass param_specs=<the parameters' PartitionSpecs>, or place the parameters first.")
  specs = leaf_specs(params, param_specs)
  check_leaf_specs(params, specs, dict(mesh.shape), (axis_name,), who)
  local = tuple(local_shape(x.shape, spec, dict(mesh.shape))
                for x, spec in zip(jax.tree.leaves(params), specs))
  return ParamLayout(jax.tree.structure(params), tuple(specs), local)


def _state_specs(tx: optax.GradientTransformation, params, mesh, axis_name: str,
                 layout: ParamLayout):
  """The specs of ``tx``'s state: its structure on one device (``tx.init`` traced in a
  ``shard_map``, shapes only), laid out by :func:`~spardl_jax._src.sync.placement.state_specs`."""
  abstract = jax.tree.map(
      lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
      params, layout.spec_tree())
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=(layout.spec_tree(),),
                       out_specs=PartitionSpec(), check_vma=False)
  with use_param_specs(layout.spec_tree()):
    local = jax.eval_shape(init, abstract)
  _check_every_leaf_synced(local, params)
  return state_specs(local, device_spec(mesh.axis_names, axis_name), layout)


def _check_every_leaf_synced(state, params) -> None:
  """Under ``optax.masked`` or ``optax.multi_transform`` a sync sees only its part of the
  gradients; a float leaf that no sync sees reaches the optimizer as each device's own
  gradient, and the replicated parameters drift apart with no error. Every float leaf must
  be seen by some sync (optimizers without any sync are left alone)."""
  syncs = [node for node in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, SyncState))
           if isinstance(node, SyncState)]
  if not syncs:
    return
  seen = sum(len(sync.built_for.shapes) for sync in syncs)
  floats = synced_leaves(params)
  if seen < len(floats):
    raise ValueError(
        f"the optimizer's gradient syncs see {seen} of the {len(floats)} float parameter "
        f"leaves (optax.masked or optax.multi_transform around a sync?): the others would "
        f"be applied with each device's own gradient, and the replicas would drift apart. "
        f"Give every part a sync (sj.sync_gradients('dense') for the leaves to keep dense), "
        f"or keep leaves dense inside one sync with dense_leaves='vectors' (or N).")


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
  layout = _param_layout(params, mesh, axis_name, param_specs, "opt_state_specs")
  specs = _state_specs(tx, params, mesh, axis_name, layout)
  if axis_names is None:
    return specs
  return jax.tree.map(lambda spec: restrict(spec, set(axis_names)), specs,
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
  layout = _param_layout(params, mesh, axis_name, param_specs, "init_opt_state")
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=(layout.spec_tree(),),
                       out_specs=_state_specs(tx, params, mesh, axis_name, layout),
                       check_vma=False)
  with use_param_specs(layout.spec_tree()):
    return jax.jit(init)(params)


def sync_state_filter(opt_state, *, prefix: tuple = ("opt_state",)):
  """A path filter that selects the sync's per-device leaves in a Flax NNX state.

  ``nnx.Optimizer(model, tx)`` keeps ``tx``'s state under ``opt_state``; in an
  ``nnx.shard_map`` over the data axis those leaves need ``PartitionSpec(axis_name)`` and
  the rest ``PartitionSpec()``: ``nnx.StateSharding({sj.sync_state_filter(
  optimizer.opt_state): P("data"), ...: P()})`` says so (docs/api.md, "Flax").

  Args:
    opt_state: the optax state (``optimizer.opt_state``), holding one or more
      :class:`~spardl_jax.states.SyncState`.
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


def _named_data_axis(error: ValueError, data: tuple[str, ...]) -> ValueError:
  """The one-line rule where the model's code names a data axis in a sharding: inside the
  step those axes are manual (each data shard runs alone), and JAX refuses such a spec from
  deep inside the model (when tracing it, or when lowering the step); ``error`` itself
  otherwise."""
  text = str(error)
  named = [a for a in data if f"'{a}'" in text]
  if not named or "anual" not in text:  # "manual" / "Manual": what the data axes are
    return error
  return ValueError(
      f"data_parallel_step: loss_fn names the data axis {named[0]!r} in a sharding "
      f"(with_sharding_constraint, out_sharding, a Flax sharding rule); inside the step each "
      f"data shard runs alone, so name only the mesh's other axes there, e.g. "
      f"P(None, 'model') for P({named[0]!r}, 'model'). JAX said: {text.splitlines()[0]}")


def _split_batch(batch, mesh, split: PartitionSpec, data: tuple[str, ...]):
  """The batch's leading axis laid over the data axes, whatever layout it came in (a
  replicated array, an uncommitted one), as the step's ``shard_map`` needs it; a clear error
  for a leaf whose leading axis the data devices do not divide."""
  devices = math.prod(mesh.shape[a] for a in data)
  explicit = all(mesh.axis_types[mesh.axis_names.index(a)] == jax.sharding.AxisType.Explicit
                 for a in data)

  def place(path, b):
    if not jnp.ndim(b) or jnp.shape(b)[0] % devices:
      raise ValueError(
          f"data_parallel_step: batch{jax.tree_util.keystr(path)} has shape {jnp.shape(b)}; "
          f"its leading (example) axis is split over the data axes {data} ({devices} "
          f"devices) and must be a multiple of {devices}.")
    target = NamedSharding(mesh, split)
    return jax.reshard(b, target) if explicit else jax.lax.with_sharding_constraint(b, target)

  return jax.tree_util.tree_map_with_path(place, batch)


def _checked_loss(loss_fn, has_aux: bool):
  """``loss_fn`` whose result is checked as it is traced: a float scalar loss (the mean of
  the examples it is given), and with ``has_aux`` a ``(loss, aux)`` pair whose aux leaves
  are arrays or numbers; a clear error otherwise, before any work."""
  def checked(*args):
    out = loss_fn(*args)
    pair = isinstance(out, (tuple, list))
    if has_aux and not (pair and len(out) == 2):
      raise TypeError(f"data_parallel_step: has_aux=True, so loss_fn must return (loss, "
                      f"aux), got {f'{len(out)} values' if pair else 'one value'}.")
    if pair and not has_aux:
      raise TypeError("data_parallel_step: loss_fn returned a tuple; if it is (loss, aux), "
                      "pass has_aux=True.")
    loss = out[0] if has_aux else out
    shape, dtype = jnp.shape(loss), getattr(loss, "dtype", None)
    if shape != () or dtype is None and not isinstance(loss, float) or (
        dtype is not None and not jnp.issubdtype(dtype, jnp.floating)):
      raise TypeError(f"data_parallel_step: loss_fn must return a float scalar, the mean loss "
                      f"of the examples it is given, got {dtype or type(loss).__name__}"
                      f"{list(shape) if shape else ''}"
                      + ("; take the mean over the examples (jnp.mean)" if shape else "")
                      + ".")
    if has_aux:
      for path, leaf in jax.tree_util.tree_flatten_with_path(out[1])[0]:
        if not (isinstance(leaf, (int, float, bool)) or hasattr(leaf, "dtype")):
          raise TypeError(f"data_parallel_step: aux{jax.tree_util.keystr(path)} is a "
                          f"{type(leaf).__name__}; aux leaves must be arrays or numbers "
                          f"(they are reduced over the data axis).")
    return out

  return checked


def _reduce_aux(aux, rows: int | None, data: tuple[str, ...]):
  """``aux`` over the data axis: per-example leaves (a leading axis of the local batch's
  ``rows``) gathered in batch order, float leaves averaged, integer and boolean ones summed
  (counts)."""
  def reduce(a):
    a = jnp.asarray(a)
    if rows is not None and a.ndim and a.shape[0] == rows:
      return jax.lax.all_gather(a, data, tiled=True)
    if jnp.issubdtype(a.dtype, jnp.floating):
      return jax.lax.pmean(a, data)
    return jax.lax.psum(a.astype(jnp.int32) if a.dtype == jnp.bool_ else a, data)

  return jax.tree.map(reduce, aux)


def _check_params(params) -> None:
  """The step takes the gradient of every parameter leaf: each must be floating-point (an
  integer leaf, a step counter say, belongs in the model's state, not in what is trained)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.inexact):
      raise TypeError(
          f"data_parallel_step: params{jax.tree_util.keystr(path)} is {dtype}; the step takes "
          f"the gradient of every parameter leaf, and only floating-point ones have one. "
          f"Keep integer leaves (counters, masks) out of params, or make the leaf float.")


def _data_axes(mesh, axis_name: str, local_axis: str | None) -> tuple[str, ...]:
  """The step's data axes, ``(axis_name,)`` or ``(axis_name, local_axis)``, checked."""
  check_axis(mesh, axis_name, "data_parallel_step")
  if local_axis is None:
    return (axis_name,)
  check_axis(mesh, local_axis, "data_parallel_step", "local_axis")
  if local_axis == axis_name:
    raise ValueError(f"data_parallel_step: local_axis must be a mesh axis other than "
                     f"axis_name={axis_name!r} (a second data axis inside a host), got "
                     f"{local_axis!r}.")
  return (axis_name, local_axis)


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

  The mesh's axes may be ``Explicit`` or ``Auto``; the step is traced under ``mesh`` whether
  it is called inside ``jax.set_mesh`` or not. Inside it each data shard runs alone, so a
  sharding constraint in ``loss_fn`` names only the mesh's other axes (``P(None, 'model')``
  for ``P('data', 'model')``; one naming the data axis is refused with this rule).

  Args:
    loss_fn: ``loss_fn(params, *batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``), the
      mean loss of the examples it is given.
    tx: the optimizer, a chain with the sync first.
    mesh: the mesh; the batch's leading dimension is sharded over ``axis_name``.
    axis_name: the data axis.
    local_axis: for a hierarchical sync (``tx`` built with the same ``local_axis``, which
      the step checks), the second data axis inside a host; the batch is then sharded over
      both.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

  Returns:
    ``step(params, opt_state, *batch) -> (params, opt_state, loss[, aux])``, jitted (the
    parameters' layout is read from the arrays, so it needs no ``param_specs``). ``loss``
    is the mean over the data axis (the same on every device); of ``aux``, a leaf with a
    leading axis of the device's batch rows is per example and is gathered in batch order
    (the global batch's), other float leaves are means and integer or boolean ones sums
    (counts) over the data axis. A loss that is not a float scalar, or an aux that is not
    arrays or numbers, is refused when the step is traced.
    ``opt_state`` comes from :func:`init_opt_state`. On several CPU devices of one process
    (simulated devices) the step bounds how far a loop dispatches ahead itself
    (:func:`spardl_jax.bounded_dispatch`), so a plain Python loop over it needs nothing else.

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
  data = _data_axes(mesh, axis_name, local_axis)
  if not callable(loss_fn):
    raise TypeError(f"data_parallel_step: loss_fn must be callable, got {type(loss_fn).__name__}.")
  split = PartitionSpec(data if local_axis else axis_name)
  others = tuple(a for a in mesh.axis_names if a not in data and mesh.shape[a] > 1)
  # On Explicit axes the new parameters' types carry their layout; on Auto ones it is kept.
  auto = all(mesh.axis_types[mesh.axis_names.index(a)] == jax.sharding.AxisType.Auto
             for a in others)
  built, tx = tx, optax.with_extra_args_support(tx)

  def local(params, opt_state, batch, param_specs):
    if (local_axis is not None and holds(opt_state, PER_REPLICA) and not any(
        s.built_for.axes == (local_axis,) for s in states_in(opt_state, SyncState))):
      raise ValueError(f"data_parallel_step: the optimizer state keeps a replica per device "
                       f"of {axis_name!r} (an outer loop, spardl_jax.diloco); with local_axis="
                       f"{local_axis!r} the devices of a host would drift apart. Drop "
                       f"local_axis, or make each host an island: give the outer loop's "
                       f"inner optimizer a sync over {local_axis!r} "
                       f"(sj.sync_gradients('dense', axis_name={local_axis!r})).")
    with use_param_specs(param_specs):  # the layout, for a look-ahead's sync (as tx.update)
      at = gradient_point(built, opt_state, params)  # a replica, a look-ahead; else params
    out, grads = jax.value_and_grad(_checked_loss(loss_fn, has_aux), has_aux=has_aux)(
        at, *batch)
    updates, opt_state = tx.update(grads, opt_state, params, param_specs=param_specs,
                                   batch_axes=data)
    rows = jax.tree.leaves(batch)[0].shape[0] if jax.tree.leaves(batch) else None
    reduced = (jax.lax.pmean(out[0], data), _reduce_aux(out[1], rows, data)) if has_aux \
        else jax.lax.pmean(out, data)
    return optax.apply_updates(params, updates), opt_state, reduced

  # The parameters' specs travel as a static argument (a tuple, one spec per leaf): each
  # layout gets its own trace, and the arrays' shardings are part of jit's cache key anyway.
  @functools.partial(jax.jit, static_argnums=2)
  def jitted(params, opt_state, shown, *batch):
    specs = None if shown is None else jax.tree.unflatten(jax.tree.structure(params), shown)
    rows = state_specs(opt_state, split)
    batch = _split_batch(batch, mesh, split, data)
    params, opt_state, out = jax.shard_map(
        functools.partial(local, param_specs=specs), mesh=mesh,
        in_specs=(PartitionSpec(), rows, split), out_specs=(PartitionSpec(), rows, PartitionSpec()),
        axis_names=set(data), check_vma=False)(params, opt_state, batch)
    if specs is not None and auto:  # the compiler would pick the new layout; keep it
      params = jax.tree.map(lambda p, spec: jax.lax.with_sharding_constraint(
          p, NamedSharding(mesh, spec)), params, specs)
    return (params, opt_state, *(tuple(out) if has_aux else (out,)))

  def shown(params):
    """The parameters' specs where the arrays carry them (placed arrays, or Explicit axes);
    None for ones traced on Auto axes (the sync then asks for ``param_specs``)."""
    if not specs_shown(params, mesh, others):
      return None
    return tuple(leaf_specs(params))

  def call(method, params, opt_state, *batch):
    _check_params(params)
    # Traced under its own mesh, in jax.set_mesh or not: a model's constraints written with
    # bare PartitionSpecs (Flax's sharding rules, the guides) need a mesh in context, and
    # the trace is the same either way (no second compile). Inside a jax.jit of the user's
    # own no mesh can be set; theirs stands.
    try:
      context = jax.set_mesh(mesh)
    except ValueError:
      context = contextlib.nullcontext()
    try:
      with context:
        return method(params, opt_state, shown(params), *batch)
    except ValueError as error:
      rule = _named_data_axis(error, data)
      if rule is error:
        raise
      raise rule from None

  # On simulated CPU devices a loop that never waits can deadlock XLA:CPU's launches: the
  # step bounds its own dispatch there (and waits for nothing elsewhere).
  step = bounded_dispatch(functools.partial(call, jitted))
  step.lower = functools.partial(call, jitted.lower)  # type: ignore[attr-defined]  # for the HLO
  return step
