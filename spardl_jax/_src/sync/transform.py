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
from spardl_jax._src.core.density import DensityRule

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
                   momentum_masking: bool = True, residual_decay: float | None = None,
                   param_specs=None, local_axis: str | None = None, dense_leaves=None, delay: int = 0,
                   balance: str | None = None, **options) -> optax.GradientTransformationExtraArgs:
  """Synchronizes gradients across ``axis_name`` with the all-reduce ``method``.

  ``update`` runs inside ``jax.shard_map`` over ``axis_name`` with each device's local
  gradient and returns the mean over the axis, bit-identical on every device (typed
  *varying*: the step returns the new parameters with ``check_vma=False``). The float leaves
  are flattened into one vector in their promoted dtype, reduced by one all-reduce and cast
  back; other leaves pass through. What the method does not send stays in each device's
  residual, so the books are exact: ``sum(new residuals) + P * y == sum(g + old
  residuals)``. A non-finite gradient on any device is seen by all in the same step, and
  with ``nonfinite='skip'`` that sync returns zeros and keeps its state (do not wrap the sync
  in ``optax.apply_if_finite``, a per-device decision: a hang). docs/design.md defines every
  option exactly: "Convergence options", "Delayed sync", "Sharded models", "Non-finite
  gradients".

  Example (8 devices, SparDL at 1 %, its residual ``(8, n)`` in all):

    >>> import jax, jax.numpy as jnp, optax, spardl_jax as sj
    >>> mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    >>> tx = optax.chain(sj.sync_gradients("spardl", density=0.01, warmup_steps=100),
    ...                  optax.sgd(0.1, momentum=0.9))
    >>> sj.init_opt_state(tx, {"w": jnp.zeros((100, 10))}, mesh)[0].method_state.residual.shape
    (8, 1000)

  Args:
    method: a registered method's name (:func:`spardl_jax.methods.names`).
    axis_name: the data-parallel mesh axis.
    axis_size: the devices on the axis, only where ``init`` runs outside ``shard_map``
      with no mesh set (:func:`spardl_jax.init_opt_state` needs none).
    nonfinite: ``'skip'`` (zeros and the state kept, on every device alike) or
      ``'propagate'``.
    warmup_steps: dense syncs first (``pmean`` of gradient plus residual, which empties);
      an int >= 0.
    momentum: DGC's momentum correction: each device syncs its velocity ``u <- m u + g``
      (the optimizer after it then has none), or None.
    momentum_masking: DGC's factor masking: ``u`` zeroed where the synced result is nonzero.
    residual_decay: SparseLoCo's decayed error feedback ``e <- beta e + g``, beta in [0, 1],
      or None.
    param_specs: the parameters' ``PartitionSpec`` s over the mesh, where the sync cannot
      read them (a ``shard_map`` over every axis, ``Auto`` axes): this argument, then
      ``tx.update(..., param_specs=...)``, then :func:`spardl_jax.use_param_specs`.
    local_axis: a second data axis reduced densely inside each host around the method (a
      hierarchical sync: only the method's traffic crosses ``axis_name``), or None.
    dense_leaves: leaves averaged by one dense ``pmean`` beside the method: ``"vectors"``
      (at most one dimension), an int N (fewer than N entries), a callable of a leaf's
      shape, or None.
    delay: 1 to send at each step the gradient of the step before (the transfer may then
      run under the step's compute; the stale update wants a smaller step or
      :func:`spardl_jax.weight_prediction`), or 0.
    balance: ``"leaves"`` to scale each leaf by a power of two to the vector's size before
      the method selects (exact books), or None.
    **options: the method's options (SparDL's ``density``: a number, a schedule ``[(step,
      density), ...]``, ``"auto"`` or a :func:`spardl_jax.density_rule`; ``teams``,
      ``sag``, ``residuals``, ``wire``, ``alpha``, ``beta``). DGC's local clipping is no
      option: chain ``optax.clip_by_global_norm(c / sqrt(P))`` before the sync.

  Returns:
    A :class:`SyncTransformation` (an ``optax.GradientTransformationExtraArgs`` carrying its
    validated ``options``) whose state is a :class:`~spardl_jax.states.SyncState`; ``update``'s
    extra arguments: ``param_specs``, ``batch_axes`` (the axes the step split its batch
    over, checked), ``extra_bytes`` (bytes a transformation around the sync sent for it,
    counted in its statistics) and, with ``delay=1``, ``next_message`` (``(synced,
    gradient) -> message`` leaf by leaf, the message held for the next step).

  References:
    Lin et al., "Deep Gradient Compression", ICLR 2018 (momentum correction, masking,
    warm-up). Vogels et al., "PowerSGD", NeurIPS 2019 (dense start). Sarfi et al.,
    "SparseLoCo", arXiv 2508.15706 (the decayed error feedback).
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

  Args:
    density: fraction of each block kept by every top-k selection, in (0, 1]; or a schedule
      ``[(step, density), ...]`` starting at step 0 (:func:`spardl_jax.density_warmup`);
      or ``"auto"``, picked from the devices P (:func:`spardl_jax.density_rule`: 2.5 % at
      P = 8 to 5 % at 64, for steps that do not grow with P).
    **options: the other fields of :class:`~spardl_jax.collectives.SparDLConfig`
      (``teams``, ``sag``, ``residuals``, ``wire``, ``alpha``, ``beta``) and
      :func:`sync_gradients`' options, each documented once, there.

  Returns:
    An ``optax.GradientTransformation`` (state :class:`~spardl_jax.states.SyncState`).

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
    An ``optax.GradientTransformation`` (state :class:`~spardl_jax.states.SyncState`; the method
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

