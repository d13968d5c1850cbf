"""DeMo: each device's momentum is its error feedback, a sparse sync sends the largest
entries of it, and every coordinate that arrives moves by the learning rate.

Peng et al., "DeMo: Decoupled Momentum Optimization" (2024), train decoders at AdamW's loss
while exchanging a small fraction of each device's momentum. This is their optimizer with
any of our sparse methods as the transport: the sync's residual, decayed by ``decay`` before
the new gradient is added (``sync_gradients``' ``residual_decay``), is the momentum, and
what the method sends leaves it. Two pieces of DeMo are not here: the DCT (the top-k runs on
the momentum itself) and the per-chunk top-k (each method selects as it always does:
TopkA over the device's whole vector, SparDL over the blocks of its schedule).
"""

from __future__ import annotations

import optax

from spardl_jax._src.core.config import check_number
from spardl_jax._src.recipes.synced_adam import check_rate_and_decay
from spardl_jax._src.sync.registry import is_sparse, names
from spardl_jax._src.sync.transform import sync_gradients

__all__ = ['demo']


def demo(learning_rate: optax.ScalarOrSchedule, *, density=0.01, method: str = "topka",
         decay: float = 0.999, weight_decay: float = 0.0, mask=None,
         **sync_options) -> optax.GradientTransformationExtraArgs:
  """DeMo's optimizer around a sparse sync: the sign of the synced momentum, with AdamW's
  decoupled weight decay.

  Each device ``i`` keeps a momentum ``m_i`` (the sync's residual, ``(P, n)`` like any
  residual). A step, inside the data-parallel ``jax.shard_map``:

  * ``m_i <- decay * m_i + g_i`` with the device's own gradient ``g_i``;
  * the sparse ``method`` all-reduces the entries it selects from the ``m_i`` (their mean
    ``q``, the same on every device) and each ``m_i`` keeps what it did not send: the
    momentum is the error feedback, nothing is lost, the unsent part waits (decaying);
  * the update is ``-learning_rate * (sign(q) + weight_decay * params)``: a coordinate the
    sync delivered moves by the learning rate, one it did not moves by the weight decay
    alone. ``mask`` limits the decay to some leaves, as ``optax.adamw``'s.

  A step the sync skips (a non-finite gradient, ``nonfinite='skip'``) delivers zeros: no
  coordinate moves but by the weight decay, and each momentum stays as it was. The sync's
  other options apply as they are: ``warmup_steps`` (dense syncs first, each a step of
  sign descent on the mean gradient), ``dense_leaves`` (those leaves' mean gradient is
  averaged every step and its sign taken; they keep no momentum), ``wire``, ``delay``.

  Example:

    >>> import jax, jax.numpy as jnp, spardl_jax as sj
    >>> mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    >>> tx = sj.demo(1e-3, density=0.01, weight_decay=0.1)
    >>> state = sj.init_opt_state(tx, {"w": jnp.zeros((100, 10))}, mesh)
    >>> state[0].method_state.residual.shape  # each device's momentum
    (8, 1000)

  Args:
    learning_rate: a float or an optax schedule.
    density: the sparse method's density (or schedule, or ``"auto"``).
    method: a registered sparse method with error feedback (``"topka"``, DeMo's own
      all-gather; ``"spardl"``; ...).
    decay: the momentum's decay ``beta`` in [0, 1] (DeMo's default 0.999).
    weight_decay, mask: AdamW's decoupled weight decay, >= 0, and its mask.
    **sync_options: :func:`~spardl_jax.sync_gradients`' other options (``axis_name``,
      ``wire``, ``warmup_steps``, ``dense_leaves``, ...).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its state is a tuple whose first entry is
    the sync's :class:`~spardl_jax.states.SyncState`.

  References:
    Peng, Quesnelle and Kingma, "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870,
    2024 (Algorithm 1: the momentum's top-k sent and subtracted, the sign of the mean).
  """
  who = "demo"
  if method not in names() or not is_sparse(method):
    sparse = [m for m in names() if is_sparse(m)]
    raise ValueError(f"{who}: method must be a sparse method with error feedback, one of "
                     f"{sparse}, got {method!r}: DeMo's momentum is the residual such a "
                     f"method keeps.")
  check_number(who, "decay", decay, "a number in [0, 1]", accept=lambda b: 0 <= b <= 1)
  check_rate_and_decay(who, learning_rate, weight_decay)
  for taken in ("residual_decay", "momentum"):
    if sync_options.get(taken) is not None:
      raise ValueError(f"{who}: {taken}={sync_options[taken]} would put a second momentum "
                       f"beside DeMo's (the residual decayed by decay={decay}); set decay "
                       f"instead.")
  sync = sync_gradients(method, density=density, residual_decay=decay, **sync_options)
  return optax.chain(sync, optax.scale_by_sign(),
                     optax.add_decayed_weights(weight_decay, mask),
                     optax.scale_by_learning_rate(learning_rate))
