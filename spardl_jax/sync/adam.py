"""Adam with a frozen second moment: the Adam-family optimizer that follows a sparse sync.

Per-coordinate normalisation by ``sqrt(nu)`` misbehaves on a sparse, bursty gradient: a
coordinate that arrives once in a hundred steps (with a hundred steps of residual mass)
inflates its ``nu`` and is then damped for the next thousand steps, while the ones that
arrive rarely and small are blown up. 1-bit Adam (Tang et al., 2021), 0/1 Adam and Bagua's
QAdam therefore run plain Adam during a dense warm-up, when the gradient is the true mean
gradient, and then **freeze** ``nu``: from then on Adam is a fixed diagonal preconditioner
and the compressed phase only moves the first moment. ``scale_by_frozen_adam`` is that
optimizer; pair its ``freeze_step`` with the sync's ``warmup_steps``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from spardl_jax.core.config import check_number

__all__ = ['ScaleByFrozenAdamState', 'scale_by_frozen_adam']


class ScaleByFrozenAdamState(NamedTuple):
  """State of :func:`scale_by_frozen_adam`.

  Attributes:
    count: () int32, the updates so far.
    mu: the first moment, the params' structure.
    nu: the second moment, frozen from ``freeze_step`` on.
    nu_count: () int32, the updates that trained ``nu`` (its bias correction): those up to
      ``freeze_step`` that were not zero everywhere.
  """

  count: jax.Array  # type: ignore[assignment]  # a field named count shadows tuple.count
  mu: optax.Updates
  nu: optax.Updates
  nu_count: jax.Array


def scale_by_frozen_adam(*, freeze_step: int, b1: float = 0.9, b2: float = 0.999,
                         eps: float = 1e-8) -> optax.GradientTransformation:
  """Adam's scaling whose second moment stops updating after ``freeze_step`` updates.

  Before the freeze this is ``optax.scale_by_adam``. From update ``freeze_step + 1`` on,
  ``nu`` and its bias correction keep the values they had after update ``freeze_step``;
  ``mu`` goes on as usual (``b1=0``: no first moment, e.g. after a sync with DGC's
  momentum correction, which already delivers a momentum).

  An update that is zero everywhere (what a sync returns for a step it skipped, see
  ``nonfinite='skip'``) does not train ``nu``: ``nu`` and its bias-correction count stay
  as they were (decaying it as Adam does would shrink the frozen value for the rest of the
  run: to about 0.7x after one skip in a 3-step warm-up). The skipped step still counts
  towards ``freeze_step``, as it counts towards the sync's ``warmup_steps``, so the freeze
  stays where the sync turns sparse: the frozen ``nu`` is that of the warm-up's other
  updates alone.

  Args:
    freeze_step: updates that train ``nu`` (an int >= 1; the sync's dense warm-up).
    b1, b2: the moments' decay rates, in [0, 1).
    eps: added to ``sqrt(nu_hat)``, a finite number > 0 (coordinates a sparse sync never
      delivered keep ``nu = 0``; ``eps = 0`` would divide 0 by 0 there).

  Returns:
    An ``optax.GradientTransformation`` with state :class:`ScaleByFrozenAdamState`.

  References:
    Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
    Convergence Speed", ICML 2021 (warm-up, then a frozen variance).
  """
  who = "scale_by_frozen_adam"
  freeze_step = check_number(who, "freeze_step", freeze_step, "an int >= 1", integral=True,
                             accept=lambda s: s >= 1)
  b1, b2 = (check_number(who, name, value, "in [0, 1)", accept=lambda b: 0 <= b < 1)
            for name, value in (("b1", b1), ("b2", b2)))
  eps = check_number(who, "eps", eps, "a finite number > 0",
                     accept=lambda e: 0 < e < float("inf"))

  def init_fn(params):
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
    return ScaleByFrozenAdamState(jnp.zeros((), jnp.int32), zeros(), zeros(),
                                  jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    count = state.count + 1
    nonzero = jnp.any(jnp.asarray([jnp.any(g != 0) for g in jax.tree.leaves(updates)]))
    training = (count <= freeze_step) & nonzero
    nu_count = state.nu_count + training.astype(jnp.int32)
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
    nu = jax.tree.map(lambda v, g: jnp.where(training, b2 * v + (1 - b2) * g * g, v),
                      state.nu, updates)
    mu_scale = 1 / (1 - b1 ** count.astype(jnp.float32))
    # Before any trained update nu is 0 (and so is mu): any finite scale gives 0.
    nu_scale = 1 / (1 - b2 ** jnp.maximum(nu_count, 1).astype(jnp.float32))
    out = jax.tree.map(lambda m, v: (m * mu_scale) / (jnp.sqrt(v * nu_scale) + eps), mu, nu)
    return out, ScaleByFrozenAdamState(count, mu, nu, nu_count)

  return optax.GradientTransformation(init_fn, update_fn)
