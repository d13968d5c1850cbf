"""The optax transformation that synchronizes gradients with a sparse all-reduce.

``optax.chain(spardl(axis_name="data", density=0.01), optax.sgd(0.1))`` turns each device's
local gradient pytree into the synchronized mean gradient, inside a data-parallel
``jax.shard_map`` train step. The per-device residual lives in the optimizer state with a
leading device axis: ``(P, n)`` globally, sharded ``PartitionSpec(axis_name)``, ``(1, n)`` on
each device (see :mod:`spardl_jax.sync.data_parallel` for the shardings and a sharded init).
"""

from __future__ import annotations

import functools
import inspect
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from spardl_jax.core import protocol
from spardl_jax.core import nonfinite as nonfinite_policy
from spardl_jax.core.allreduce import axis_size as bound_axis_size
from spardl_jax.core.allreduce import bound_axes
from spardl_jax.core.nonfinite import NonFinite
from spardl_jax.sync import levels, mesh_axes

__all__ = ['SyncStats', 'SyncState', 'sync_gradients', 'spardl', 'powersgd', 'sync_stats']


class SyncStats(NamedTuple):
  """Statistics of the last synchronization, gathered without any communication.

  Each field is ``(1,)`` on a device and ``(P,)`` globally (one entry per device).

  Attributes:
    selected: int32, nonzero entries of the synchronized gradient (same on every device).
    bytes_sent: float32, bytes this device sent (the method's formula, checked against the
      compiled HLO by the tests).
    residual_norm: float32, L2 norm of this device's residual after the synchronization.
    h: int32, pairs per block sent across teams by SparDL (B-SAG's adaptive ``h``; ``kb``
      otherwise; 0 for dense).
    nonfinite: int32, syncs so far in which some device's gradient (or residual) was not
      finite (NaN or inf); the same on every device. Under ``nonfinite='skip'`` those syncs
      returned zeros and left the method's state as it was.
    density: float32, the density of the level the last sync used (1 for the dense
      warm-up and for dense methods).
  """

  selected: jax.Array
  bytes_sent: jax.Array
  residual_norm: jax.Array
  h: jax.Array
  nonfinite: jax.Array
  density: jax.Array


@protocol.folds(velocity=protocol.SUM, count=protocol.SAME)
class SyncState(NamedTuple):
  """State of :func:`sync_gradients`; every leaf has a leading device axis.

  Attributes:
    method_state: the all-reduce's per-device state (for SparDL a
      :class:`~spardl_jax.SparDLState` whose ``residual`` is ``(1, n)`` on a device and
      ``(P, n)`` globally), in the promoted dtype of the gradient leaves.
    velocity: ``(1, n)`` on a device, this device's momentum-corrected velocity ``u`` (only
      with ``momentum``; None otherwise). Like the residual it is a per-device sum of
      gradient mass, and a restore onto another device count folds it the same way.
    count: ``(1,)`` int32, the syncs so far (the same on every device); it picks the level.
    stats: :class:`SyncStats` of the last update.
  """

  method_state: Any
  velocity: jax.Array | None
  count: jax.Array  # type: ignore[assignment]  # a field named count shadows tuple.count
  stats: SyncStats


def states_in(tree, cls: type) -> list:
  """The nodes of type ``cls`` (a state NamedTuple) inside ``tree``, in tree order."""
  return [node for node in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, cls))
          if isinstance(node, cls)]


def _float_leaves(tree) -> tuple[list, Any]:
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
  if not leaves:
    raise ValueError("sync_gradients: the gradient pytree has no floating-point leaves to "
                     "synchronize.")
  return leaves, jnp.result_type(*(x.dtype for x in leaves))


def _devices(axis_name, axis_size: int | None) -> tuple[int, int]:
  """``(lead, p)``: the leading device axis of the state ``init`` creates here, and the
  number of devices on the axis."""
  try:
    return 1, jax.lax.axis_size(axis_name)  # Inside shard_map: this device's own slice.
  except NameError:  # the axis is not bound here: outside shard_map
    pass
  if axis_size is not None:
    return axis_size, axis_size
  bound = bound_axes()
  if bound:
    raise ValueError(
        f"sync_gradients: axis_name={axis_name!r}, but init runs inside jax.shard_map over "
        f"the axes {bound}; pass the data-parallel axis of that mesh as "
        f"axis_name (the same to the transformation and to init_opt_state).")
  mesh = jax.sharding.get_abstract_mesh()
  if axis_name in mesh.axis_names:
    return mesh.shape[axis_name], mesh.shape[axis_name]
  raise ValueError(
      f"sync_gradients: init was called outside shard_map, so the number of devices on axis "
      f"{axis_name!r} is unknown. Use spardl_jax.init_opt_state(tx, params, mesh), call init "
      f"inside jax.shard_map, run under jax.set_mesh(mesh), or pass axis_size=P.")


@functools.cache
def _apply_if_finite_code() -> frozenset:
  wrapped = optax.apply_if_finite(optax.identity(), 1)
  return frozenset({wrapped.init.__code__, wrapped.update.__code__})


def _refuse_apply_if_finite() -> None:
  """Raises when ``optax.apply_if_finite`` is calling this sync's init or update.

  It decides on each device's own gradient, before the sync, whether to run it: a device
  with a NaN skips the collectives the others wait in (a hang, then an abort after 40 s on
  CPU). The wrapper's state is not visible from inside, and a state can be built by
  ``tx.init`` under ``shard_map``, with ``axis_size`` or with ``init_opt_state``, so the
  check looks for the wrapper's own functions among the callers: one walk of the Python
  stack at trace time, nothing in the compiled step.
  """
  codes = _apply_if_finite_code()
  frame = inspect.currentframe()
  while frame is not None:
    if frame.f_code in codes:
      raise ValueError(
          "sync_gradients: optax.apply_if_finite wraps a gradient sync. It decides on each "
          "device's own gradient before the sync runs, so a device with a NaN would skip "
          "the collectives the others wait in (a hang). The sync agrees on every device "
          "itself: use nonfinite='skip' (the default), which zeroes that step's update "
          "everywhere and keeps the residuals; wrap only optimizers that come after the "
          "sync.")
    frame = frame.f_back


def _check_options(momentum, momentum_masking, clip_norm, axis_size) -> None:
  if momentum is not None and (isinstance(momentum, bool) or not isinstance(
      momentum, numbers.Real) or not 0 <= float(momentum) < 1):
    raise ValueError(f"sync_gradients: momentum must be None or a number in [0, 1), got "
                     f"{momentum!r}.")
  if not isinstance(momentum_masking, bool):
    raise ValueError(f"sync_gradients: momentum_masking must be True or False, got "
                     f"{momentum_masking!r}.")
  if clip_norm is not None and (isinstance(clip_norm, bool) or not isinstance(
      clip_norm, numbers.Real) or not 0 < float(clip_norm) < float("inf")):
    raise ValueError(f"sync_gradients: clip_norm must be None or a finite number > 0, got "
                     f"{clip_norm!r}.")
  if axis_size is not None and (isinstance(axis_size, bool) or not isinstance(axis_size, int)
                                or axis_size < 1):
    raise ValueError(f"sync_gradients: axis_size must be a positive int, got {axis_size!r}.")


def _run_level(level: levels.Level, x, local, *, n: int, p: int, itemsize: int, axis_name):
  """One level's sync of ``x``: ``(y, new_local, bytes_sent, h)``, typed alike for every
  level so that ``lax.switch`` can choose among them."""
  if level.dense:  # deliver the residual's mass too, and empty it
    owed = protocol.residual(local)
    y, _ = level.allreduce.apply(x if owed is None else x + owed, (), axis_name=axis_name)
    if owed is not None:
      local = local._replace(residual=jnp.zeros_like(owed))
    bytes_sent, h = level.allreduce.stats(n=n, p=p, itemsize=itemsize, state=(), rank=None)
  else:
    y, local = level.allreduce.apply(x, local, axis_name=axis_name)
    bytes_sent, h = level.allreduce.stats(n=n, p=p, itemsize=itemsize, state=local,
                                          rank=jax.lax.axis_index(axis_name))
  return y, local, jnp.asarray(bytes_sent, jnp.float32), jnp.asarray(h, jnp.int32)


class _Shapes(NamedTuple):
  """What an update's gradients fix at trace time: the float leaves' shapes, their total
  ``n`` and promoted dtype, and the levels bound to those leaves."""

  leaf_shapes: tuple
  n: int
  dtype: Any
  levels: list


def _stats(y, new_local, bytes_sent, h, bad, old: SyncStats, *, density) -> SyncStats:
  """Stage 5: this sync's :class:`SyncStats`, from what every device already holds."""
  residual = protocol.residual(new_local)
  return SyncStats(
      selected=jnp.count_nonzero(y).astype(jnp.int32)[None],
      bytes_sent=bytes_sent[None],
      h=h[None],
      residual_norm=(jnp.zeros((1,), jnp.float32) if residual is None else
                     jnp.linalg.norm(residual.astype(jnp.float32))[None]),
      nonfinite=old.nonfinite + bad.astype(jnp.int32),
      density=density.astype(jnp.float32)[None])


def _unflatten(floats, leaves) -> list:
  """Stage 6: ``leaves`` with the float ones replaced by ``floats`` (the synced result cut
  back into them, :func:`spardl_jax.sync.mesh_axes.unpack`); other leaves pass through."""
  new = iter(floats)
  return [next(new) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in leaves]


def sync_gradients(method: str = "spardl", *, axis_name: str = "data",
                   axis_size: int | None = None, nonfinite: NonFinite = "skip",
                   warmup_steps: int = 0, momentum: float | None = None,
                   momentum_masking: bool = True, clip_norm: float | None = None,
                   param_specs=None, local_axis: str | None = None,
                   **options) -> optax.GradientTransformation:
  """Synchronizes gradients across ``axis_name`` with the all-reduce ``method``.

  ``update`` must run inside ``jax.shard_map`` over ``axis_name`` with the local gradient
  of each device; it returns the mean gradient over the axis, bit-identical on every device
  (typed *varying* by JAX, so the train step needs ``check_vma=False`` to return the new
  parameters replicated). All floating-point leaves are flattened into one vector in their
  promoted dtype (e.g. float32 for a bfloat16/float32 mix), reduced in one all-reduce, and
  cast back to each leaf's dtype. Non-float leaves (integers, ``float0``) pass through
  unchanged and are not communicated.

  **Convergence options** (each one composable with the others; see ``docs/design.md``):

  * ``warmup_steps=W``: the first ``W`` syncs are dense (``pmean`` of the gradient plus the
    residual, which then empties), as the SparDL authors' code and PyTorch's PowerSGD hook
    (``start_powerSGD_iter``) do.
  * ``density=[(0, 0.25), (100, 0.0625), (200, 0.01)]``: a density schedule for the sparse
    method (:func:`spardl_jax.density_warmup` builds DGC's). Every level is built and
    compiled once into the one train step and chosen with ``lax.switch`` by the step count,
    so no step recompiles. Entering a level restarts the method's other state (the B-SAG
    controller, thresholds) for the new size; the residual carries over.
  * ``momentum=m`` (DGC's momentum correction): each device keeps its velocity
    ``u <- m u + g`` and the all-reduce synchronizes ``u`` (plus the residual) instead of
    ``g``, so the optimizer after the sync must have **no** momentum
    (``optax.sgd(lr)``). With ``momentum_masking`` (default) ``u`` is zeroed where the
    synchronized result is nonzero (the coordinates every device just applied), so stale
    momentum does not push them again; dense warm-up steps do not mask. At density 1 without
    masking this is momentum SGD on the mean gradient.
  * ``clip_norm=c``: each device first rescales its own gradient to L2 norm at most
    ``c / sqrt(P)`` (DGC's local clipping: the mean of ``P`` such gradients has norm at most
    ``c / sqrt(P)`` under independence, about what a global clip at ``c`` allows the sum).

  Whatever is accumulated, the bookkeeping stays exact (for SparDL with global residuals):
  ``sum(new residuals) + P * y == sum(u (or g) + old residuals)`` up to float rounding.

  **Sharded models.** On a mesh of several axes the sync reduces over ``axis_name`` only,
  and the parameters may be sharded over the other axes (FSDP, tensor parallelism): each
  column of the data axis (the devices at one position on the other axes) syncs its own
  local shards, concatenated, so nothing is gathered over the other axes, and the top-k of a
  sparse method is taken per column (:mod:`spardl_jax.sync.mesh_axes`; ``docs/design.md``,
  "Sharded models"). The state then has one row per device of the whole mesh. This works in a
  ``shard_map`` over all the mesh's axes (the gradients are local shards), in a partial-auto
  ``shard_map(..., axis_names={axis_name})`` (the sync opens a ``shard_map`` over the other
  axes itself) and under ``jax.jit`` through :func:`spardl_jax.data_parallel_step`.

  **Hierarchical sync** (``local_axis``). On a ``(host, local)`` mesh with the batch sharded
  over both axes, ``axis_name="host", local_axis="local"`` first reduces the gradients
  densely inside each host (a reduce-scatter over ``local``: each device gets the host's
  mean on its 1/L slice), then runs the method across hosts on every slice in parallel
  (``L`` all-reduces over ``host``, one per column), then all-gathers the slices inside the
  host. Only the method's traffic crosses the slow axis; each host acts as one worker, so
  clipping, momentum correction and the residual apply to the host's mean slice.

  **Non-finite gradients.** Every device learns in the same step whether any device's
  gradient (plus residual) holds a NaN or an inf, and all take the same decision, so no
  device ever skips a collective the others wait in. With ``nonfinite='skip'`` (default)
  that sync returns zeros on every device and leaves the method's state (residuals,
  velocities, the B-SAG controller, thresholds) exactly as before, so one bad step poisons
  nothing; the ``nonfinite`` counter of :class:`SyncStats` counts such steps.
  ``'propagate'`` returns what the all-reduce computed (NaNs included) and keeps its new
  state. The optimizer after the sync then sees a zero gradient: plain SGD does not move,
  momentum and Adam moments decay by one step. Do not wrap the sync in
  ``optax.apply_if_finite``: it decides on each device's own gradient before the sync runs
  (a hang); :func:`spardl_jax.opt_state_specs` rejects that structure.

  Args:
    method: a registered method's name (:func:`spardl_jax.methods.names`).
    axis_name: the data-parallel mesh axis.
    axis_size: number of devices on the axis, only needed when ``init`` runs outside
      ``shard_map`` without a mesh set (:func:`spardl_jax.init_opt_state` needs none).
    nonfinite: ``'skip'`` or ``'propagate'``, see above.
    warmup_steps: dense syncs before the sparse ones (an int >= 0).
    momentum: DGC momentum correction factor in [0, 1), or None (off).
    momentum_masking: DGC momentum factor masking (with ``momentum``).
    clip_norm: DGC local gradient clipping threshold (> 0), or None (off).
    local_axis: a second data axis reduced densely inside each host around the method
      (see "Hierarchical sync"), or None.
    param_specs: the parameters' ``PartitionSpec`` s over the mesh (a pytree of the
      parameters' structure), needed only where the sync cannot read them: in a
      ``shard_map`` over every axis (it sees local shards), in a partial-auto ``shard_map``
      whose other axes are ``Auto``, and for ``init`` of traced parameters under
      ``jax.set_mesh`` with ``Auto`` axes. Concrete arrays and ``Explicit`` axes carry their
      own; :func:`spardl_jax.init_opt_state` and :func:`spardl_jax.data_parallel_step` pass
      what they know.
    **options: the method's options (for ``'spardl'``: ``density`` (a number or a
      schedule), ``teams``, ``sag``, ``residuals``, ``alpha``, ``beta``).

  Returns:
    An ``optax.GradientTransformation`` whose state is a :class:`SyncState`.

  References:
    Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
    Distributed Training", ICLR 2018 (momentum correction, factor masking, local clipping,
    warm-up). Vogels et al., "PowerSGD", NeurIPS 2019 (dense start, ``start_powerSGD_iter``).
  """
  nonfinite_policy.check_policy("sync_gradients", nonfinite)
  _check_options(momentum, momentum_masking, clip_norm, axis_size)
  if local_axis is not None and (not isinstance(local_axis, str) or local_axis == axis_name):
    raise ValueError(f"sync_gradients: local_axis must be None or the name of a mesh axis "
                     f"other than axis_name={axis_name!r}, got {local_axis!r}.")
  data_axes = (axis_name,) if local_axis is None else (axis_name, local_axis)
  unbound = levels.build(method, options, warmup_steps=warmup_steps)
  reaches_result = all(level.allreduce.nonfinite_reaches_result for level in unbound)

  def fresh_state(all_levels, n, dtype, p):
    """The last level's all-reduce owns the state; every sparse level's must share its
    structure (checked on shapes only, nothing allocated)."""
    shapes = {jax.tree.structure(jax.eval_shape(
        functools.partial(level.allreduce.init, n=n, dtype=dtype, p=p)))
              for level in all_levels if not level.dense}
    if len(shapes) > 1:
      raise ValueError(f"sync_gradients: the density levels of {method!r} keep states of "
                       f"different structures; use one density.")
    return all_levels[-1].allreduce.init(n=n, dtype=dtype, p=p)

  # The float leaf shapes init has seen: the state holds one flat vector, so gradients of
  # another structure with the same total size would silently mix entries of other leaves.
  # Validation memory only; nothing computed depends on it.
  initialized_for: set[tuple] = set()

  def layout_of(tree, floats, specs) -> tuple[mesh_axes.Segment, ...]:
    """How this device's float leaves make its flat vector (``specs``: every leaf's spec
    over the whole mesh, or None where the caller has none)."""
    mesh = jax.sharding.get_abstract_mesh()
    bound = set(bound_axes())
    others = {a: mesh.shape[a] for a in mesh.axis_names
              if a in bound and a not in data_axes and mesh.shape[a] > 1}
    if not others:
      check_leafwise(False, ())
      return (mesh_axes.Segment((), tuple(range(len(floats))), sum(x.size for x in floats),
                                sum(x.size for x in floats)),)
    given = param_specs if param_specs is not None else mesh_axes.given_specs()
    if specs is None:
      if given is None:
        raise ValueError(
            f"sync_gradients: the sync runs inside a shard_map over the mesh axes "
            f"{tuple(others)} besides {axis_name!r}, where each device holds only its shards "
            f"and the sync cannot see which parameters are replicated over those axes; pass "
            f"param_specs=<the parameters' PartitionSpecs> (the in_specs of your shard_map) "
            f"to the transformation.")
      specs = mesh_axes.leaf_specs(tree, given)
    float_specs = [spec for x, spec in zip(jax.tree.leaves(tree), specs)
                   if jnp.issubdtype(x.dtype, jnp.floating)]
    layout = mesh_axes.segments([x.shape for x in floats], float_specs, others)
    check_leafwise(any(seg.axes for seg in layout), tuple(others))
    return layout

  def check_leafwise(sliced: bool, others) -> None:
    """A method that compresses each leaf as a matrix cannot take slices of the leaves."""
    if not any(level.allreduce.leafwise for level in unbound):
      return
    if local_axis is not None:
      raise ValueError(f"sync_gradients: {method!r} compresses each parameter as a matrix, "
                       f"but local_axis={local_axis!r} syncs slices of the flat gradient; use "
                       f"a method that sees one flat vector (sj.methods.names()).")
    if sliced:
      raise ValueError(
          f"sync_gradients: {method!r} compresses each parameter as a matrix, but some "
          f"parameters are replicated over the mesh axes {tuple(others)}, whose slices the "
          f"sync spreads over those axes; shard every parameter over them, or use a method "
          f"that sees one flat vector (sj.methods.names()).")

  def synced_size(layout) -> int:
    """Entries of the vector the method syncs on this device: its packed leaves, or with a
    ``local_axis`` its 1/L slice of them."""
    n = sum(seg.chunk for seg in layout)
    if local_axis is None:
      return n
    return -(-n // bound_axis_size(local_axis, who="sync_gradients: local_axis"))

  def init_local(params, specs=None):
    leaves, dtype = _float_leaves(params)
    initialized_for.add(tuple(tuple(x.shape) for x in leaves))
    lead, p = _devices(axis_name, axis_size)
    n = synced_size(layout_of(params, leaves, specs))

    def per_device(a):
      a = jnp.asarray(a)
      return jnp.broadcast_to(a[None], (lead, *a.shape))

    stats = SyncStats(selected=jnp.zeros((lead,), jnp.int32),
                      bytes_sent=jnp.zeros((lead,), jnp.float32),
                      residual_norm=jnp.zeros((lead,), jnp.float32),
                      h=jnp.zeros((lead,), jnp.int32),
                      nonfinite=jnp.zeros((lead,), jnp.int32),
                      density=jnp.zeros((lead,), jnp.float32))
    velocity = None if momentum is None else jnp.zeros((lead, n), dtype)
    all_levels = levels.for_leaves(unbound, [x.shape for x in leaves])
    return SyncState(jax.tree.map(per_device, fresh_state(all_levels, n, dtype, p)), velocity,
                     jnp.zeros((lead,), jnp.int32), stats)

  def check_state(state, shapes, p: int):
    """Stage 1: ``state`` is this sync's, as one device sees it inside ``shard_map``, for
    gradients of these float leaf ``shapes``; returns the method's per-device state."""
    if not isinstance(state, SyncState):
      raise TypeError(f"sync_gradients: state must be the SyncState from init, got "
                      f"{type(state).__name__}.")
    for leaf in jax.tree.leaves(state):
      if leaf.shape[:1] != (1,):
        raise ValueError(
            f"sync_gradients: update must run inside jax.shard_map over {axis_name!r} with the "
            f"state sharded PartitionSpec({axis_name!r}) (each device sees a leading axis of "
            f"1), got a state leaf of shape {leaf.shape}; see spardl_jax.opt_state_specs.")
    if (state.velocity is None) != (momentum is None):
      raise ValueError("sync_gradients: the state was initialized with another momentum "
                       "setting; init with this transformation.")
    if initialized_for and shapes.leaf_shapes not in initialized_for:
      raise ValueError(f"sync_gradients: the gradients' float leaves have the shapes "
                       f"{shapes.leaf_shapes}, but init saw {sorted(initialized_for)}; init "
                       f"with the same params.")
    local = jax.tree.map(lambda a: a[0], state.method_state)
    expected = jax.eval_shape(lambda: fresh_state(shapes.levels, shapes.n, shapes.dtype, p))
    # jaxlib ships PyTreeDef.__eq__ but no stub for it: the checker cannot see it.
    same = jax.tree.structure(local) == jax.tree.structure(expected)  # type: ignore[operator]
    if not same or any(
        a.shape != b.shape for a, b in zip(jax.tree.leaves(local), jax.tree.leaves(expected))):
      raise ValueError(
          f"sync_gradients: the state does not fit {method!r} for {shapes.n} float entries (it "
          f"holds {type(local).__name__} with shapes "
          f"{[a.shape for a in jax.tree.leaves(local)]}); init it with this transformation "
          f"and the same params.")
    return local

  def local_gradient(flat, old_velocity, p: int):
    """Stage 2: DGC's local clipping, then its momentum correction (the velocity is what
    travels): ``(what the all-reduce sums, the new velocity or None)``."""
    if clip_norm is not None:
      norm = jnp.linalg.norm(flat.astype(jnp.float32))
      limit = clip_norm / np.sqrt(p)
      flat = (flat * jnp.minimum(1.0, limit / jnp.maximum(norm, 1e-30))).astype(flat.dtype)
    if momentum is None:
      return flat, None
    velocity = (momentum * old_velocity[0] + flat).astype(flat.dtype)
    return velocity, velocity

  def run_levels(shapes, x, local, count, p: int):
    """Stage 3: the level of sync ``count`` runs (``lax.switch`` among compiled levels):
    ``(y, new_local, bytes_sent, h, level index, local as the level saw it)``."""
    def run(level, x, local):
      return _run_level(level, x, local, n=shapes.n, p=p,
                        itemsize=np.dtype(shapes.dtype).itemsize, axis_name=axis_name)

    if len(shapes.levels) == 1:
      return (*run(shapes.levels[0], x, local), jnp.zeros((), jnp.int32), local)
    starts = np.array([level.start for level in shapes.levels])
    index = (jnp.sum(count >= starts) - 1).astype(jnp.int32)
    # Entering a sparse level restarts the method's other state for its size; the residual
    # (delivered or still owed mass) carries over.
    entering = jnp.isin(count, starts[1:])
    fresh = fresh_state(shapes.levels, shapes.n, shapes.dtype, p)
    owed = protocol.residual(local)
    if owed is not None:
      fresh = fresh._replace(residual=owed)
    local = jax.tree.map(lambda a, b: jnp.where(entering, a, b), fresh, local)
    y, new_local, bytes_sent, h = jax.lax.switch(
        index, [functools.partial(run, level) for level in shapes.levels], x, local)
    return y, new_local, bytes_sent, h, index, local

  def agree_on_nonfinite(x, y, local, new_local, velocity, old_velocity, shapes, index):
    """Stage 4: DGC's momentum factor masking, then the non-finite guard every device
    agrees on: ``(y, new_local, velocity, bad)``."""
    bad = nonfinite_policy.any_device(reaches_result, x, local, y, axis_name)
    columns = tuple(a for a in bound_axes() if a != axis_name)
    if columns:  # every column skips, or none: a step is never applied to some shards only
      bad = jax.lax.pmax(bad.astype(jnp.int32), columns) > 0
    if velocity is not None and momentum_masking:
      sparse = ~jnp.asarray([level.dense for level in shapes.levels])[index]
      velocity = jnp.where(sparse & (y != 0), jnp.zeros_like(velocity), velocity)
    if nonfinite == "skip":
      y, new_local = nonfinite_policy.skip_if(bad, y, new_local, local)
      if velocity is not None:
        velocity = jnp.where(bad, old_velocity[0], velocity)
    return y, new_local, velocity, bad

  def update_local(updates, state, specs=None):
    p = bound_axis_size(axis_name, who="sync_gradients: update")
    leaves, treedef = jax.tree.flatten(updates)
    floats, dtype = _float_leaves(updates)
    layout = layout_of(updates, floats, specs)
    shapes = _Shapes(tuple(tuple(x.shape) for x in floats), synced_size(layout),
                     dtype, levels.for_leaves(unbound, [x.shape for x in floats]))
    local = check_state(state, shapes, p)
    flat = mesh_axes.pack(floats, dtype, layout)
    x, velocity = local_gradient(flat if local_axis is None else
                                 mesh_axes.scatter_mean(flat, local_axis), state.velocity, p)
    y, new_local, bytes_sent, h, index, local = run_levels(shapes, x, local, state.count[0], p)
    y, new_local, velocity, bad = agree_on_nonfinite(x, y, local, new_local, velocity,
                                                     state.velocity, shapes, index)
    stats = _stats(y, new_local, bytes_sent, h, bad, state.stats,
                   density=jnp.asarray([lv.density for lv in shapes.levels])[index])
    new_state = SyncState(jax.tree.map(lambda a: a[None], new_local),
                          None if velocity is None else velocity[None], state.count + 1, stats)
    if local_axis is not None:
      y = mesh_axes.gather(y, local_axis, flat.size)
    return (jax.tree.unflatten(treedef, _unflatten(mesh_axes.unpack(y, floats, layout), leaves)),
            new_state)

  def shard_specs(tree, axes, who):
    """Each leaf's spec over the mesh (a list) and over the ``axes`` the sync must open
    itself (a tree, for ``shard_map``); a clear error where it cannot know them."""
    mesh = jax.sharding.get_abstract_mesh()
    others = tuple(a for a in axes if a not in data_axes and mesh.shape[a] > 1)
    if not others:  # data axes only: the parameters are replicated
      return None, jax.tree.map(lambda _: PartitionSpec(), tree)
    given = param_specs if param_specs is not None else mesh_axes.given_specs()
    if given is None and not mesh_axes.layout_known(tree, mesh, others):
      raise ValueError(
          f"sync_gradients: {who} runs where the mesh axes {others} are left to the compiler "
          f"(Auto), so the sync cannot see how the parameters are sharded over them; pass "
          f"param_specs=<the parameters' PartitionSpecs> to the transformation, or make "
          f"those mesh axes Explicit.")
    specs = mesh_axes.leaf_specs(tree, given)
    mesh_axes.check_leaf_specs(tree, specs, dict(mesh.shape), data_axes,
                               f"sync_gradients: {who}")
    return specs, jax.tree.unflatten(jax.tree.structure(tree),
                                     [mesh_axes.restrict(spec, axes) for spec in specs])

  def init_fn(params):
    _refuse_apply_if_finite()
    axes = mesh_axes.unbound_axes(axis_name)  # a partial-auto shard_map's other axes
    mesh = jax.sharding.get_abstract_mesh()
    if not axes and axis_size is None and not bound_axes() and axis_name in mesh.axis_names:
      axes = tuple(mesh.axis_names)  # outside shard_map, under a mesh: each device its rows
    if not axes:
      return init_local(params)
    rows = (mesh_axes.device_spec(axes, axis_name) if axis_name in axes
            else PartitionSpec(axes))
    specs, over = shard_specs(params, axes, "init")
    return mesh_axes.on_local_shards(functools.partial(init_local, specs=specs), axes, (over,),
                                     rows)(params)

  def update_fn(updates, state, params=None):
    del params
    _refuse_apply_if_finite()
    axes = mesh_axes.unbound_axes(axis_name)
    if not axes:
      return update_local(updates, state)
    specs, over = shard_specs(updates, axes, "update")
    rows = jax.tree.map(lambda _: PartitionSpec(axes), state)
    return mesh_axes.on_local_shards(functools.partial(update_local, specs=specs), axes,
                                     (over, rows), (over, rows))(updates, state)

  return optax.GradientTransformation(init_fn, update_fn)


def spardl(*, density: float | levels.DensitySchedule = 0.01,
           **options) -> optax.GradientTransformation:
  """SparDL gradient synchronization as an optax transformation:
  ``sync_gradients("spardl", density=density, **options)``.

  Example (the paper's behaviour; each device keeps its residual, ``(P, n)`` in all):

    >>> import jax, jax.numpy as jnp, optax, spardl_jax as sj
    >>> mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    >>> tx = optax.chain(spardl(axis_name="data", density=0.01), optax.sgd(0.1, momentum=0.9))
    >>> opt_state = sj.init_opt_state(tx, {"w": jnp.zeros((100, 10))}, mesh)
    >>> opt_state[0].method_state.residual.shape
    (8, 1000)

  With DGC's momentum correction the momentum moves before the sync, and the optimizer
  after it has none (``docs/design.md`` measures each option):

    >>> tx = optax.chain(spardl(density=0.01, warmup_steps=100, momentum=0.9), optax.sgd(0.1))

  Args:
    density: fraction of each block kept by every top-k selection, in (0, 1]; or a schedule
      ``[(step, density), ...]`` starting at step 0 (:func:`spardl_jax.density_warmup`).
    **options: the other fields of :class:`~spardl_jax.SparDLConfig` (``teams``, ``sag``,
      ``residuals``, ``wire``, ``alpha``, ``beta``; their defaults are its) and the options
      of :func:`sync_gradients` (``axis_name``, ``axis_size``, ``nonfinite``, and the
      convergence options ``warmup_steps``, ``momentum``, ``momentum_masking``,
      ``clip_norm``). Each is defined, and documented, once, there.

  Returns:
    An ``optax.GradientTransformation`` (state :class:`SyncState`).

  References:
    Zhao et al., "SparDL: Distributed Deep Learning Training with Efficient Sparse
    Communication", ICDE 2024. Lin et al., "Deep Gradient Compression", ICLR 2018.
  """
  return sync_gradients("spardl", density=density, **options)


def powersgd(*, start_iter: int = 0, **options) -> optax.GradientTransformation:
  """PowerSGD gradient synchronization (what PyTorch DDP's ``powerSGD_hook`` does):
  ``sync_gradients("powersgd", warmup_steps=start_iter, **options)``.

  Example:

    >>> import optax
    >>> tx = optax.chain(powersgd(rank=4, start_iter=100), optax.sgd(0.1, momentum=0.9))

  Args:
    start_iter: dense all-reduces before the compression starts (PyTorch's
      ``start_powerSGD_iter``; it is :func:`sync_gradients`' ``warmup_steps``).
    **options: the fields of :class:`~spardl_jax.baselines.powersgd.PowerSGDConfig`
      (``rank``, ``min_compression_rate``, ``seed``) and :func:`sync_gradients`' options
      (``axis_name``, ``axis_size``, ``nonfinite``).

  Returns:
    An ``optax.GradientTransformation`` (state :class:`SyncState`; the method state is a
    :class:`~spardl_jax.baselines.powersgd.PowerSGDState` with the error feedback as its
    ``residual``).

  References:
    Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
    Optimization", NeurIPS 2019.
  """
  return sync_gradients("powersgd", warmup_steps=start_iter, **options)


def sync_stats(opt_state) -> SyncStats:
  """The :class:`SyncStats` inside an optimizer state (e.g. of an ``optax.chain``).

  Raises:
    ValueError: if the state holds no or several :class:`SyncState`.
  """
  found = states_in(opt_state, SyncState)
  if len(found) != 1:
    raise ValueError(f"sync_stats: expected one SyncState in the optimizer state, found "
                     f"{len(found)}.")
  return found[0].stats

