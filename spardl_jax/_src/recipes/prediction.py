"""Where a step with a delayed sync takes its gradient: one step ahead, at its own estimate.

With ``delay=1`` the gradient a step computes at ``x_t`` is applied one step later, at
``x_{t+1}``. Stale gradients make momentum SGD unstable at the learning rates it is tuned
for (docs/design.md, "Delayed sync"): on a quadratic, heavy ball with momentum 0.9 is stable
up to ``lr * L = 3.8`` without the delay and up to 0.1 with it. The step from ``x_t`` to
``x_{t+1}`` is the optimizer's update of what the sync is delivering, which is in flight
while the gradient is computed; but each device can estimate it from what it holds: its
message of the step before plus its residual, cut to the entries the sync's level keeps
(what it would deliver if every device held the same). Taking the gradient at
``x_t + after.update(that estimate)`` puts it where it will be applied whenever the estimate
is right (exactly for a dense sync and equal gradients), so the step keeps the undelayed
step's stability; what still lags is the devices' disagreement. The parameters keep their
layout (replicated over the data axis, sharded over a model axis as they were, the estimate
made on each device's shards): the look-ahead is a point each device evaluates its loss at,
never stored.
"""

from __future__ import annotations

import weakref

import jax
import jax.numpy as jnp
import optax

from spardl_jax._src.core import protocol, topk
from spardl_jax._src.core.allreduce import axis_size
from spardl_jax._src.sync import entries, flat_layout, levels, stages, transform
from spardl_jax._src.sync import registry as methods
from spardl_jax._src.sync.flat_layout import LeafSpecs
from spardl_jax._src.sync.specs import context_specs
from spardl_jax._src.sync.moves import moves_the_point
from spardl_jax._src.sync.sync_state import SyncState

__all__ = ["weight_prediction", "predicted_params", "predicted_delivery"]

_AFTER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def weight_prediction(sync: optax.GradientTransformation, *after: optax.GradientTransformation,
              scale: float = 1.0) -> optax.GradientTransformationExtraArgs:
  """``optax.chain(sync, *after)`` for a delayed ``sync``, whose step takes its gradient
  ahead (:func:`predicted_params`).

  Args:
    sync: a :func:`~spardl_jax.sync_gradients` built with ``delay=1`` on the data axis
      alone (no ``local_axis``, parameters replicated over every other mesh axis).
    *after: what follows the sync (the optimizer, and clipping before it if any).
    scale: the fraction of the estimate to look ahead by, in [0, 1]: 1 where each device's
      estimate is close to the mean (it is exact for equal gradients and a dense sync); less
      where one device's gradient is a noisy sample of the step's (a few examples a device),
      whose estimate overshoots; 0 is the plain delayed chain.

  Returns:
    The chain; its state is ``(sync state, state of chain(*after))``.

  Example (4 devices; each takes its gradient at its own point, the parameters stay one):

    >>> import jax, jax.numpy as jnp, optax, spardl_jax as sj
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    >>> tx = sj.weight_prediction(sj.spardl(axis_name="data", density=0.5, delay=1),
    ...                   optax.sgd(0.1, momentum=0.9))
    >>> params = {"w": jnp.zeros(8)}
    >>> specs = sj.opt_state_specs(tx, params, mesh)
    >>> def step(params, opt_state, target):
    ...   point = sj.points.predicted_params(tx, opt_state, params)
    ...   loss = lambda p: jnp.sum((p["w"] - target[0]) ** 2)
    ...   grads = jax.grad(loss)(jax.lax.pcast(point, "data", to="varying"))
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   return optax.apply_updates(params, updates), opt_state, point["w"][None]
    >>> step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
    ...                              out_specs=(P(), specs, P("data")), check_vma=False))
    >>> opt_state = sj.init_opt_state(tx, params, mesh)
    >>> target = jax.device_put(jnp.arange(4.0)[:, None] * jnp.ones((4, 8)),
    ...                         jax.NamedSharding(mesh, P("data")))
    >>> for _ in range(3):
    ...   params, opt_state, points = step(params, opt_state, target)
    >>> points.shape  # step 3's point on each device: ahead by its own estimate
    (4, 8)
    >>> import numpy as np
    >>> bool(np.any(np.asarray(points)[0] != np.asarray(points)[3]))
    True

  """
  options = transform.built_with(sync)
  if options is None or not options.delay:
    raise ValueError("weight_prediction: sync must be a sync_gradients(..., delay=1); the gradient of "
                     "an undelayed sync is applied where it was taken, so there is nothing "
                     "to look ahead to.")
  if options.local_axis is not None:
    raise ValueError(f"weight_prediction: a sync with local_axis={options.local_axis!r} holds its "
                     f"host's mean, not this device's gradient; use it without weight_prediction.")
  if not after:
    raise ValueError("weight_prediction: give the transformations after the sync (the optimizer); "
                     "the look-ahead is their update of the held message.")
  if not 0 <= scale <= 1:
    raise ValueError(f"weight_prediction: scale must be in [0, 1], got {scale!r}.")
  rest = optax.chain(*after)
  tx = optax.chain(sync, rest)
  _AFTER[tx.update] = (sync, rest, float(scale))
  return tx


@moves_the_point(1)  # from the replica, where an outer loop holds one
def predicted_params(tx: optax.GradientTransformation, opt_state, params):
  """The point this device takes its gradient at: ``params`` plus what ``tx``'s
  optimizer would do with this device's estimate of the sync's next delivery
  (:func:`predicted_delivery`, times the look-ahead's ``scale``), inside the data-parallel
  ``shard_map``; ``params`` unchanged where ``tx`` is no :func:`weight_prediction`
  (:func:`~spardl_jax.gradient_point` applies it with the other moves of the point).

  Nothing is stored and no collective runs: the update is taken from the current state and
  dropped. Before the first message is held the estimate is zero (momentum alone moves the
  point). The estimate costs one selection over the method's vector a step (on a sparse
  level), as the sync's own does.
  """
  found = _AFTER.get(tx.update)
  if found is None:
    return params
  sync, rest, scale = found
  sync_state, rest_state = opt_state
  estimate = jax.tree.map(lambda e: e * jnp.asarray(scale, e.dtype),
                          predicted_delivery(sync, sync_state, params))
  step, _ = rest.update(estimate, rest_state, params)
  return optax.apply_updates(params, step)


def predicted_delivery(sync: optax.GradientTransformation, state: SyncState, params):
  """This device's estimate of what its delayed ``sync`` delivers at the next update, as a
  tree like ``params`` (zeros for non-float leaves and before any message is held), inside
  the data-parallel ``shard_map``.

  On the method's vector: the held message plus the method's residual where it keeps one
  (``(1, n)``), and for a sparse level the entries of the largest magnitudes only, as many
  as the level's density keeps (``max(1, round(density * n))``; ties kept; with ``balance``
  ranked on the vector scaled leaf by leaf, as the sync scales it) — the level the
  count of syncs selects, as the sync will. The dense leaves (``dense_leaves``) are their
  held values. A non-sparse level (the dense warm-up, ``dense``, PowerSGD) keeps every
  entry.
  """
  options = transform.built_with(sync)
  if (options is None or not options.delay or not isinstance(state, SyncState)
      or state.pending is None):
    raise ValueError("predicted_delivery: sync must be a sync_gradients(..., delay=1) and "
                     "state its SyncState.")
  # On this device's shards, as the sync's own update runs (a model axis left open).
  given = options.given_specs(context_specs(), "use_param_specs (data_parallel_step passes "
                              "the arrays' layout there)", "predicted_params")
  return entries.on_local_shards(
      options, lambda tree, local, where: _predicted_local(options, local, tree, where),
      params, state, given=given, who="predicted_params", returns_state=False)


def _predicted_local(options, state: SyncState, params, where: LeafSpecs):
  """:func:`predicted_delivery` on this device's shards."""
  pending = state.pending
  assert pending is not None  # predicted_delivery checked
  leaves, treedef = jax.tree.flatten(params)
  split = flat_layout.split_leaves(options, params, where)
  vec, kept = stages.unpack(pending.message[0], split.layout.n, split.kept)
  vec = _kept_by_the_level(options, state, vec, split)
  estimate = flat_layout.merge_float_leaves(
      split.dense, split.layout.unflatten(vec, split.method), kept)
  held = pending.held[0]
  estimate = [jnp.where(held, e.astype(x.dtype).reshape(x.shape), jnp.zeros_like(x))
              for e, x in zip(estimate, split.floats)]
  return flat_layout.with_float_leaves(treedef, leaves, estimate, other=jnp.zeros_like)


def _kept_by_the_level(options, state: SyncState, vec, split: flat_layout.Leaves):
  """``vec`` plus the residual, cut to the entries the next sync's level keeps (ranked,
  with ``balance``, on the vector scaled leaf by leaf as the sync will scale it)."""
  # The sync takes its scales from the message alone, before the residual joins it.
  scale = (None if options.balance is None else
           stages.leaf_scales(options, split.layout, vec, [x.size for x in split.method]))
  residual = protocol.residual(state.method_state)
  if residual is not None and residual.shape == (1, *vec.shape):
    vec = vec + residual[0].astype(vec.dtype)
  p = axis_size(options.axis_name, who="predicted_params")
  bound = levels.bind(list(options.levels), [x.shape for x in split.method], p)
  ranked = vec if scale is None else vec * scale

  def cut(level):
    if level.dense or not methods.is_sparse(level.allreduce.name) or level.density >= 1:
      return lambda v: v
    k = max(1, round(level.density * vec.size))

    def largest(v):
      keys = topk.keys(ranked)
      # In chunks: counting the whole vector once per key bit doubled a step of the
      # look-ahead's paced run (benchmarks/results/network.md, "Hiding the sync").
      return jnp.where(keys >= topk.kth_largest_in_chunks(keys[None], k)[0], v,
                       jnp.zeros_like(v))
    return largest

  if len(bound) == 1:
    return cut(bound[0])(vec)
  return jax.lax.switch(stages.level_index(stages.level_starts(bound), state.count[0]),
                        [cut(level) for level in bound], vec)
