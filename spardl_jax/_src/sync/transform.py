"""The optax transformation that synchronizes gradients with a sparse all-reduce.

``optax.chain(spardl(axis_name="data", density=0.01), optax.sgd(0.1))`` turns each device's
local gradient pytree into the synchronized mean gradient, inside a data-parallel
``jax.shard_map`` train step. The per-device residual lives in the optimizer state with a
leading device axis: ``(P, n)`` globally, sharded ``PartitionSpec(axis_name)``, ``(1, n)`` on
each device (see :mod:`spardl_jax._src.sync.placement` for the shardings and
:func:`spardl_jax.init_opt_state` for a sharded init). The factory validates its options once
(:class:`~spardl_jax._src.sync.settings.SyncOptions`); the stages it runs are
:mod:`spardl_jax._src.sync.stages`.
"""

from __future__ import annotations

import optax

from spardl_jax._src.core.nonfinite import NonFinite
from spardl_jax._src.sync import delay, entries, levels
from spardl_jax._src.sync.settings import SyncOptions
from spardl_jax._src.sync.specs import context_specs
from spardl_jax._src.sync.sync_state import SyncState
from spardl_jax._src.sync.density import DensityRule

__all__ = ['SyncTransformation', 'sync_gradients', 'spardl', 'powersgd', 'built_with',
           'dense_warmup', 'predicted_delivery']


class SyncTransformation(optax.GradientTransformationExtraArgs):
  """What :func:`sync_gradients` returns: an ``optax.GradientTransformationExtraArgs``
  (``init``, ``update``) that also carries, as data, the validated options it was built with
  (``options``), for the transformations that wrap a sync and must know them (Adam around the
  sync checks its warm-up, the weight prediction its delay). optax's ``lookahead`` carries its
  facts the same way, in its ``LookaheadParams``."""

  options: SyncOptions

  def __new__(cls, init, update, options: SyncOptions):
    tx = super().__new__(cls, init, update)
    tx.options = options
    return tx


def sync_gradients(method: str = "spardl", *, axis_name: str = "data",
                   axis_size: int | None = None, nonfinite: NonFinite = "skip",
                   warmup_steps: int = 0, momentum: float | None = None,
                   momentum_masking: bool = True, residual_decay: float | None = None, param_specs=None,
                   local_axis: str | None = None, dense_leaves=None, delay: int = 0,
                   balance: str | None = None, **options) -> optax.GradientTransformationExtraArgs:
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
  * ``density="auto"`` (or a :func:`spardl_jax.density_rule`): the density is picked from
    the devices P of the data axis when the sync is traced, growing with log2 P so that
    SparDL's steps to accuracy do not grow with P (docs/design.md, "The density rule").
  * ``momentum=m`` (DGC's momentum correction): each device keeps its velocity
    ``u <- m u + g`` and the all-reduce synchronizes ``u`` (plus the residual) instead of
    ``g``, so the optimizer after the sync must have **no** momentum
    (``optax.sgd(lr)``). With ``momentum_masking`` (default) ``u`` is zeroed where the
    synchronized result is nonzero (the coordinates every device just applied), so stale
    momentum does not push them again; dense warm-up steps do not mask. At density 1 without
    masking this is momentum SGD on the mean gradient.
  * DGC's local clipping is ``optax.chain(optax.clip_by_global_norm(c / sqrt(P)), sync,
    ...)``: each device rescales its own gradient before the sync sees it (the mean of ``P``
    such gradients has norm at most ``c / sqrt(P)`` under independence, about what a global
    clip at ``c`` allows the sum).

  * ``residual_decay=beta`` (SparseLoCo's decayed error feedback): each device scales its
    residual by ``beta`` before adding the new gradient (``e <- beta e + g``), so mass a
    sync leaves behind fades instead of arriving late in full. In an outer loop
    (:func:`spardl_jax.diloco`) with a plain outer step it stands in for DiLoCo's outer
    momentum (SparseLoCo's observation); any method with error feedback takes it.

  * ``dense_leaves``: leaves the method never sees, averaged by a dense ``pmean`` every step
    instead (as PyTorch's PowerSGD hook keeps 1-D tensors dense): ``"vectors"`` (biases,
    norm scales: leaves of at most one dimension), ``N`` (leaves of fewer than ``N``
    entries on a device), or a callable taking a leaf's shape and returning True to keep it
    dense. Under Adam every coordinate moves by about the learning rate whatever its
    gradient's size, so a bias or a norm scale that a global top-k rarely picks is starved;
    these leaves are a few per cent of a transformer's entries. Their bytes (the ring
    all-reduce's) count in :class:`SyncStats`; they keep no residual. Not with ``momentum``.

  * ``balance="leaves"``: before the method selects, each leaf is scaled by the power of two
    nearest to the ratio of the whole vector's root mean square to the leaf's (over every
    device's gradient, one all-reduce of two numbers a leaf, counted in
    :class:`SyncStats`), and the result and the residual are scaled back: one top-k over
    the vector then takes from every leaf about its share of entries instead of starving
    the leaves whose gradients are small (which Adam, moving every coordinate by about the
    learning rate, would have moved as far as any). Powers of two keep the books exact; the
    residual is kept in the gradient's units. For a method with a residual (a sparse one).

  **Delayed sync** (``delay=1``): each step sends the gradient the last step left and keeps
  its own for the next, so the update applied at step ``t`` is the sync of step ``t - 1``'s
  gradient. Inside one compiled train step the sync's collectives then depend on the state
  only, not on this step's forward and backward pass, and the runtime may run the transfer
  while they compute (PyTorch DDP overlaps its buckets with the backward pass for the same
  reason; CocktailSGD delays its compressed sync by one step; on the CPU backend, whose runtime
  may start independent collectives in another order on each device, the message waits for
  the gradient and nothing is hidden). The delayed syncs are exactly
  the undelayed ones one step later, state included: the first step delivers zeros and
  changes nothing but the held message (:class:`~spardl_jax._src.sync.sync_state.Pending`, one
  gradient per device, counted in the conservation below and folded to the devices' mean on
  a restore); a non-finite gradient is skipped one step later, as the undelayed sync would
  have skipped it. Any method takes it, with every option above. **The stale update needs a
  smaller step**: the largest stable learning rate of momentum SGD on a quadratic falls 38×
  at ``m = 0.9``, 6× at ``m = 0.5`` and 2× without momentum (``docs/design.md``, "Delayed
  sync", which also says where it pays); retune the learning rate and momentum with it, or
  take the gradient one step ahead (:func:`spardl_jax.weight_prediction`).

  Whatever is accumulated, the bookkeeping stays exact (for SparDL with global residuals):
  ``sum(new residuals) + P * y == sum(u (or g) + beta * old residuals)`` up to float
  rounding (``beta = 1`` without ``residual_decay``).

  **Sharded models.** On a mesh of several axes the sync reduces over ``axis_name`` only,
  and the parameters may be sharded over the other axes (FSDP, tensor parallelism): each
  column of the data axis (the devices at one position on the other axes) syncs its own
  local shards, concatenated, so nothing is gathered over the other axes, and the top-k of a
  sparse method is taken per column (:mod:`spardl_jax._src.sync.mesh_axes`; ``docs/design.md``,
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
    residual_decay: SparseLoCo's error-feedback decay ``beta`` in [0, 1], or None (1: the
      residual kept whole).
    local_axis: a second data axis reduced densely inside each host around the method
      (see "Hierarchical sync"), or None.
    dense_leaves: None, ``"vectors"``, an int or a callable: the leaves averaged densely
      outside the method (see above).
    delay: 0, or 1 for the delayed sync (above).
    balance: None, or ``"leaves"``: each leaf scaled to the vector's size before the method
      selects (above).
    param_specs: the parameters' ``PartitionSpec`` s over the mesh (a pytree of the
      parameters' structure), needed only where the sync cannot read them: in a
      ``shard_map`` over every axis (it sees local shards), in a partial-auto ``shard_map``
      whose other axes are ``Auto``, and for ``init`` of traced parameters under
      ``jax.set_mesh`` with ``Auto`` axes. Concrete arrays and ``Explicit`` axes carry their
      own. The sync also takes them through ``tx.update(..., param_specs=...)`` (an optax
      extra argument, which :func:`spardl_jax.data_parallel_step` passes) and, for
      ``init``, from :func:`spardl_jax.use_param_specs` (which
      :func:`spardl_jax.init_opt_state` uses); this argument wins over both.
    **options: the method's options (for ``'spardl'``: ``density`` (a number, a
      schedule, ``"auto"`` or a density rule), ``teams``, ``sag``, ``residuals``,
      ``alpha``, ``beta``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (a :class:`SyncTransformation`, which
    carries its validated ``options``) whose state is a :class:`~spardl_jax.SyncState`; its
    ``update`` takes the extra arguments ``param_specs``, ``batch_axes`` (the axes the step
    split the batch over, which :func:`spardl_jax.data_parallel_step` passes; a sync that
    reduces over other axes is refused), ``extra_bytes`` (bytes a transformation around the
    sync sent for it this step, counted in its statistics) and, with ``delay=1``,
    ``next_message``: a function ``(synced, gradient) -> message`` applied leaf by leaf to
    form the message held for the next step from this step's result (how
    :func:`spardl_jax.adam.scale_by_synced_adam` keeps one momentum).

  References:
    Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
    Distributed Training", ICLR 2018 (momentum correction, factor masking, local clipping,
    warm-up). Vogels et al., "PowerSGD", NeurIPS 2019 (dense start, ``start_powerSGD_iter``).
    Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo", arXiv
    2508.15706 (the decayed error feedback).
  """
  if "clip_norm" in options:
    raise TypeError("sync_gradients: clip_norm is retired; DGC's local clipping is an optax "
                    "clip of each device's gradient before the sync: optax.chain("
                    "optax.clip_by_global_norm(c / sqrt(P)), sync, ...).")
  config = SyncOptions(
      method, tuple(levels.build(method, options, warmup_steps=warmup_steps)),
      axis_name=axis_name, axis_size=axis_size, nonfinite=nonfinite, momentum=momentum,
      momentum_masking=momentum_masking, param_specs=param_specs,
      local_axis=local_axis, residual_decay=residual_decay, dense_leaves=dense_leaves,
      delay=delay, balance=balance)

  def init_fn(params):
    return entries.init(config, params)

  def update_fn(updates, state, params=None, *, param_specs=None, batch_axes=None,
                next_message=None, extra_bytes=0, **extra_args):
    del params, extra_args  # other transformations' extra arguments
    return entries.update(config, updates, state, param_specs, batch_axes, next_message,
                          extra_bytes)

  return SyncTransformation(init_fn, update_fn, config)


def built_with(tx: optax.GradientTransformation) -> SyncOptions | None:
  """The validated options ``tx`` was built with, or None where ``tx`` is no
  :func:`sync_gradients` (a chain, another transformation)."""
  return tx.options if isinstance(tx, SyncTransformation) else None


def dense_warmup(tx: optax.GradientTransformation) -> int | float | None:
  """The syncs ``tx`` starts with that deliver the exact mean: its ``warmup_steps`` (``inf``
  for ``"dense"``, 0 for none), or None where ``tx`` is no :func:`sync_gradients` (a chain, another
  transformation)."""
  config = built_with(tx)
  if config is None:
    return None
  # A level that is not the exact mean: past the warm-up, a method other than pmean.
  inexact = [level.start for level in config.levels
             if not level.dense and level.allreduce.name != "dense"]
  return inexact[0] if inexact else float("inf")


def spardl(*, density: float | levels.DensitySchedule | str | DensityRule = 0.01,
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
      ``[(step, density), ...]`` starting at step 0 (:func:`spardl_jax.density_warmup`);
      or ``"auto"``, picked from the devices P (:func:`spardl_jax.density_rule`: 2.5 % at
      P = 8 to 5 % at 64, for steps that do not grow with P).
    **options: the other fields of :class:`~spardl_jax.collectives.SparDLConfig` (``teams``,
      ``sag``, ``residuals``, ``wire``, ``alpha``, ``beta``; their defaults are its) and the options
      of :func:`sync_gradients` (``axis_name``, ``axis_size``, ``nonfinite``, and the
      convergence options ``warmup_steps``, ``momentum``, ``momentum_masking``,
      ``residual_decay``). Each is defined, and documented, once, there.

  Returns:
    An ``optax.GradientTransformation`` (state :class:`~spardl_jax.SyncState`).

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
    **options: the fields of :class:`~spardl_jax._src.baselines.powersgd.PowerSGDConfig`
      (``rank``, ``min_compression_rate``, ``seed``) and :func:`sync_gradients`' options
      (``axis_name``, ``axis_size``, ``nonfinite``).

  Returns:
    An ``optax.GradientTransformation`` (state :class:`~spardl_jax.SyncState`; the method
    state is a :class:`~spardl_jax._src.baselines.powersgd.PowerSGDState` with the error feedback
    as its ``residual``).

  References:
    Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
    Optimization", NeurIPS 2019.
  """
  return sync_gradients("powersgd", warmup_steps=start_iter, **options)


def predicted_delivery(sync: optax.GradientTransformation, state, params):
  """This device's estimate of what the delayed ``sync`` (a :func:`sync_gradients` with
  ``delay=1``) delivers at its next update, as a tree like ``params`` (zeros for non-float
  leaves and before any message is held), inside the data-parallel ``shard_map``, on this
  device's shards as the sync's own update runs (``delay.predicted_local`` says how it is
  made)."""
  options = built_with(sync)
  if (options is None or not options.delay or not isinstance(state, SyncState)
      or state.pending is None):
    raise ValueError("predicted_delivery: sync must be a sync_gradients(..., delay=1) and "
                     "state its SyncState.")
  given = options.given_specs(context_specs(), "use_param_specs (data_parallel_step passes "
                              "the arrays' layout there)", "predicted_params")
  return entries.on_local_shards(
      options, lambda plan, tree, local: delay.predicted_local(plan, local, tree),
      params, state, given=given, who="predicted_params", returns_state=False)

