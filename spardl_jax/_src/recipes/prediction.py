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

import jax
import jax.numpy as jnp
import optax

from spardl_jax._src.core.config import check_number
from spardl_jax._src.sync.moves import moves_the_point
from spardl_jax._src.sync.transform import built_with, predicted_delivery

__all__ = ["WeightPrediction", "weight_prediction", "predicted_params"]


class WeightPrediction(optax.GradientTransformationExtraArgs):
  """What :func:`weight_prediction` returns: ``optax.chain(sync, rest)``, carrying as data
  the delayed ``sync``, ``rest`` (the chain after it) and the prediction's ``scale``, which
  :func:`predicted_params` reads."""

  sync: optax.GradientTransformation
  rest: optax.GradientTransformation
  scale: float

  def __new__(cls, init, update, sync, rest, scale: float):
    tx = super().__new__(cls, init, update)
    tx.sync, tx.rest, tx.scale = sync, rest, scale
    return tx


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
    The chain, a :class:`WeightPrediction` that carries ``sync``, the rest and ``scale``;
    its state is ``(sync state, state of chain(*after))``.

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
  options = built_with(sync)
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
  scale = check_number("weight_prediction", "scale", scale, "in [0, 1]",
                       accept=lambda s: 0 <= s <= 1)
  rest = optax.chain(*after)
  chained = optax.chain(sync, rest)
  return WeightPrediction(chained.init, chained.update, sync, rest, float(scale))


@moves_the_point(1)  # from the replica, where an outer loop holds one
def predicted_params(tx: optax.GradientTransformation, opt_state, params):
  """The point this device takes its gradient at: ``params`` plus what ``tx``'s
  optimizer would do with this device's estimate of the sync's next delivery
  (``predicted_delivery``, times the prediction's ``scale``), inside the data-parallel
  ``shard_map``; ``params`` unchanged where ``tx`` is no :func:`weight_prediction`
  (:func:`~spardl_jax.gradient_point` applies it with the other moves of the point).

  Nothing is stored and no collective runs: the update is taken from the current state and
  dropped. Before the first message is held the estimate is zero (momentum alone moves the
  point). The estimate costs one selection over the method's vector a step (on a sparse
  level), as the sync's own does.
  """
  if not isinstance(tx, WeightPrediction):
    return params
  sync_state, rest_state = opt_state
  estimate = jax.tree.map(lambda e: e * jnp.asarray(tx.scale, e.dtype),
                          predicted_delivery(tx.sync, sync_state, params))
  step, _ = tx.rest.update(estimate, rest_state, params)
  return optax.apply_updates(params, step)
