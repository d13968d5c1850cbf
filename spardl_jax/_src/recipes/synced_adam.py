"""Adam for a sparse sync: a frozen second moment, and a first moment that travels through
the sync.

Per-coordinate normalisation by ``sqrt(nu)`` misbehaves on a sparse, bursty gradient: a
coordinate that arrives once in a hundred steps (with a hundred steps of residual mass)
inflates its ``nu`` and is then damped for the next thousand steps, while the ones that
arrive rarely and small are blown up. 1-bit Adam (Tang et al., 2021), 0/1 Adam and Bagua's
QAdam therefore run plain Adam during a dense warm-up, when the gradient is the true mean
gradient, and then **freeze** ``nu``: from then on Adam is a fixed diagonal preconditioner
and the compressed phase only moves the first moment. ``scale_by_frozen_adam`` is that
optimizer; pair its ``freeze_step`` with the sync's ``warmup_steps``.

``scale_by_synced_adam`` is 1-bit Adam's compression stage with any sync in place of its
1-bit compressor: each device folds its gradient into the shared first moment,
``m_i = b1 m + (1 - b1) g_i``, and the sync (with its error feedback) averages ``m_i``, so
what is compressed is the momentum, not the gradient.
"""

from __future__ import annotations

import math
import typing
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from spardl_jax._src.core import protocol
from spardl_jax._src.core.config import check_number
from spardl_jax._src.core.protocol import LIKE_PARAMS, REPLICATED, SAME, Field
from spardl_jax._src.sync.registry import is_sparse, names
from spardl_jax._src.sync.stages import dense_bytes
from spardl_jax._src.sync.sync_state import check_sync_alone
from spardl_jax._src.sync.transform import built_with, dense_warmup, sync_gradients

__all__ = ['ScaleByFrozenAdamState', 'scale_by_frozen_adam', 'ScaleBySyncedAdamState',
           'scale_by_synced_adam', 'Sends', 'SecondMoment', 'synced_adamw']

# What scale_by_synced_adam's sync averages, and what its second moment does after the
# warm-up.
Sends = Literal["momentum", "preconditioned"]
SENDS: tuple[str, ...] = typing.get_args(Sends)
SecondMoment = Literal["frozen", "sent", "refreshed"]
SECOND_MOMENTS: tuple[str, ...] = typing.get_args(SecondMoment)


# Adam's moments and counts are the same on every device (the frozen Adam's because the
# sync before it delivers the same mean everywhere, the synced Adam's because its sync does):
# a restore onto another device count keeps them. The moments (and the per-coordinate
# counts) lie like the parameters, the step counts replicated; the sync's state declares its
# own.
_LIKE, _ONCE = Field(LIKE_PARAMS, SAME), Field(REPLICATED, SAME)


@protocol.layout(count=_ONCE, mu=_LIKE, nu=_LIKE, nu_count=_ONCE)
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
  freeze_step, rates = _check("scale_by_frozen_adam", freeze_step, b1, b2, eps)
  b1, b2 = rates.b1, rates.b2

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
    return _scaled(rates, mu, nu, count, nu_count), ScaleByFrozenAdamState(
        count, mu, nu, nu_count)

  return optax.GradientTransformation(init_fn, update_fn)


class _Rates(NamedTuple):
  """Adam's checked decay rates and ``eps``."""

  b1: float
  b2: float
  eps: float


def _check(who, freeze_step, b1, b2, eps) -> tuple[int, _Rates]:
  freeze_step = check_number(who, "freeze_step", freeze_step, "an int >= 1", integral=True,
                             accept=lambda s: s >= 1)
  b1, b2 = (check_number(who, name, value, "in [0, 1)", accept=lambda b: 0 <= b < 1)
            for name, value in (("b1", b1), ("b2", b2)))
  eps = check_number(who, "eps", eps, "a finite number > 0",
                     accept=lambda e: 0 < e < float("inf"))
  return freeze_step, _Rates(b1, b2, eps)


def _preconditioner(nu, nu_count, b2, eps, *, identity=False):
  """Adam's divisor ``sqrt(v_hat) + eps``, ``v``'s bias correction by its own count (a
  scalar, or one per coordinate), 1s where ``identity``."""
  def divisor(v, c):
    # Before any trained update nu is 0 (and so is mu): any finite scale gives 0.
    v_hat = v / (1 - b2 ** jnp.maximum(c, 1).astype(jnp.float32))
    return jnp.where(identity, 1.0, jnp.sqrt(v_hat) + eps)

  if isinstance(nu_count, jax.Array) and nu_count.ndim == 0:
    return jax.tree.map(lambda v: divisor(v, nu_count), nu)
  return jax.tree.map(divisor, nu, nu_count)


def _scaled(rates: _Rates, mu, nu, count, nu_count):
  """Adam's bias-corrected ``m / (sqrt(v_hat) + eps)``."""
  mu_scale = 1 / (1 - rates.b1 ** count.astype(jnp.float32))
  return jax.tree.map(lambda m, d: (m * mu_scale) / d, mu,
                      _preconditioner(nu, nu_count, rates.b2, rates.eps))


@protocol.layout(count=_ONCE, mu=_LIKE, nu=_LIKE, nu_count=_LIKE, sent_at=_LIKE)
class ScaleBySyncedAdamState(NamedTuple):
  """State of :func:`scale_by_synced_adam`.

  Attributes:
    count: () int32, the updates so far.
    mu: the shared first moment (what the sync returned; the same on every device).
    nu: the second moment, trained on the mean gradient in the warm-up, then frozen or
      trained where the sync delivers (``second_moment``).
    nu_count: int32 per coordinate (the params' structure), the steps ``nu`` covers (its
      bias correction).
    sync: the sync's :class:`~spardl_jax.states.SyncState` (its residual is the momentum's error
      feedback).
    sent_at: int32 per coordinate, the update at which the sync last delivered it.
  """

  count: jax.Array  # type: ignore[assignment]  # a field named count shadows tuple.count
  mu: optax.Updates
  nu: optax.Updates
  nu_count: optax.Updates
  sync: Any
  sent_at: optax.Updates


def scale_by_synced_adam(sync: optax.GradientTransformation, *, freeze_step: int,
                         b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                         sends: Sends = "momentum", second_moment: SecondMoment = "frozen"
                         ) -> optax.GradientTransformationExtraArgs:
  """Adam's scaling around ``sync``: what the sync averages is Adam's first moment (1-bit
  Adam's compression stage, any sync as the compressor) or the gradient in Adam's frozen
  preconditioned coordinates.

  ``update(grads, state, params)`` runs inside the data-parallel ``jax.shard_map`` with each
  device's own gradient ``g_i``. Both modes run plain Adam on the mean gradient while the
  sync is dense (its ``warmup_steps``), train ``v`` on that mean gradient for
  ``freeze_step`` updates and then freeze it (1-bit Adam's warm-up, then a fixed diagonal
  preconditioner ``D = sqrt(v_hat) + eps``, the same on every device). Use
  ``freeze_step <= warmup_steps``: only a dense sync's result is the mean gradient.

  * ``sends="momentum"``: each device forms ``m_i = b1 m + (1 - b1) g_i`` from the shared
    ``m``; ``sync`` averages the ``m_i`` (its residual keeps what it did not send, so the
    momentum's mass is delivered in full, late); the result is the new shared ``m``. In the
    warm-up the mean gradient is recovered as ``(m_new - b1 m) / (1 - b1)``.
  * ``sends="preconditioned"``: after the freeze each device sends ``g_i / D``, the
    gradient in the coordinates where Adam's steps are all about the same size, and the
    sync's result times ``D`` is the mean gradient that updates ``m = b1 m + (1 - b1) g``.
    Top-k selection and its error feedback then rank and keep entries by their
    preconditioned size: a coordinate with a small ``v`` (a rare token's embedding, a norm's
    scale), which Adam moves as far as any other, is sent as often, where selecting on the
    raw gradient would leave it waiting in the residual.

  ``second_moment="sent"`` keeps training ``v`` after the warm-up where the sync delivers:
  a coordinate delivered ``a`` updates after its last delivery carries about ``a`` steps of
  mean gradient (its residual's), so ``v <- b2^a v + (1 - b2^a) (g_sent / a)^2`` with
  ``a`` more steps in its bias correction; coordinates not delivered keep ``v``.

  ``second_moment="refreshed"`` is 0/1 Adam's schedule: ``v`` frozen after the warm-up
  except at updates ``2 W, 4 W, 8 W, ...`` (``W = freeze_step``: each interval twice the
  last), where the step's mean gradient, averaged densely in full precision (one extra
  ``pmean`` of the gradient over the sync's data axes, its bytes counted in the sync's
  ``stats.bytes_sent``), trains every coordinate once: ``v <- b2 v + (1 - b2) g_mean^2``,
  one step more in the bias correction. The update itself still comes from the sync.

  The update is Adam's ``m_hat / D``. A step the sync skips (a non-finite gradient,
  ``nonfinite='skip'``) returns zeros and changes neither moment.

  With a delayed sync (``delay=1``, ``sends="momentum"``) each device's momentum message
  ``b1 m + (1 - b1) g_i`` is formed with this step's result ``m`` and sent by the next step,
  so the update at step ``t`` is Adam's with the momentum through step ``t - 1``'s gradient;
  the first step applies nothing and counts nothing.

  Example:

    >>> import jax, jax.numpy as jnp, optax, spardl_jax as sj
    >>> mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    >>> tx = optax.chain(
    ...     sj.adam.scale_by_synced_adam(sj.spardl(density=0.01, warmup_steps=100),
    ...                                  freeze_step=100),
    ...     optax.add_decayed_weights(0.01), optax.scale_by_learning_rate(1e-3))
    >>> state = sj.init_opt_state(tx, {"w": jnp.zeros((100, 10))}, mesh)
    >>> state[0].sync.method_state.residual.shape
    (8, 1000)

  Args:
    sync: the momentum's sync (:func:`~spardl_jax.spardl`,
      :func:`~spardl_jax.sync_gradients`), over the data axis, with a dense warm-up of at
      least ``freeze_step`` steps.
    freeze_step: updates that train ``v`` (an int >= 1).
    b1, b2: the moments' decay rates, in [0, 1).
    eps: added to ``sqrt(v_hat)``, a finite number > 0.
    sends: ``"momentum"`` or ``"preconditioned"`` (above).
    second_moment: ``"frozen"`` after the warm-up, trained where ``"sent"``, or
      ``"refreshed"`` densely at growing intervals (above). Frozen after a short warm-up,
      ``v`` holds few samples of the mean gradient's square, near 0 for some coordinates,
      whose steps then grow far beyond the learning rate (PowerSGD with a one-step warm-up
      diverged in two steps); ``"sent"`` goes on training it, ``"refreshed"`` now and then.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`ScaleBySyncedAdamState`; its ``update``'s extra arguments go to ``sync``.

  References:
    Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
    Convergence Speed", ICML 2021 (Algorithm 1: the momentum compressed with error
    feedback after a warm-up that freezes the variance).
  """
  freeze_step, rates = _check("scale_by_synced_adam", freeze_step, b1, b2, eps)
  b2 = rates.b2
  path = "delayed" if _check_sync(sync, freeze_step, sends, second_moment) else sends
  options = built_with(sync)  # not None where refreshed (_check_sync)
  axes = options.data_axes if second_moment == "refreshed" and options else ()
  sync = optax.with_extra_args_support(sync)

  def init_fn(params):
    sync_state = sync.init(params)
    check_sync_alone(sync_state, "scale_by_synced_adam",
                     "averages each device's first moment over the data axis")
    zeros = lambda dtype=None: jax.tree.map(  # noqa: E731
        lambda p: jnp.zeros_like(p, dtype), params)
    return ScaleBySyncedAdamState(jnp.zeros((), jnp.int32), zeros(), zeros(),
                                  zeros(jnp.int32), sync_state, zeros(jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, ScaleBySyncedAdamState):
      raise TypeError(f"scale_by_synced_adam: state must be the ScaleBySyncedAdamState from "
                      f"init, got {type(state).__name__}.")
    count = state.count + 1
    warm = count <= freeze_step
    fresh = (~warm & _refresh_due(count, freeze_step)) if axes else jnp.zeros((), bool)
    # A refresh's dense pmean is sent for the sync: the sync counts its bytes with its own.
    extra = jnp.where(fresh, _refresh_bytes(updates, axes), 0.0) if axes else 0
    synced, sync_state, mean, new_mu = _through_sync(
        lambda x, **held: sync.update(x, state.sync, params, extra_bytes=extra, **extra_args,
                                      **held),
        updates, state, _Step(path, rates, warm))
    # Every device holds the same count of skipped syncs: all decide alike.
    skipped = jnp.any(sync_state.stats.nonfinite != state.sync.stats.nonfinite)
    if axes:
      mean = _refreshed(fresh, updates, mean, axes)
    sent = jax.tree.map(
        lambda u: ~skipped & (warm | fresh | ((second_moment == "sent") & (u != 0))), synced)
    # In the warm-up and at a refresh each delivery is one step's mean gradient (a skipped
    # step, none).
    age = jax.tree.map(lambda at: jnp.where(warm | fresh, 1, count - at), state.sent_at)
    nu = jax.tree.map(
        lambda v, g, a, hit: jnp.where(hit, b2 ** a * v + (1 - b2 ** a) * (g / a) ** 2, v),
        state.nu, mean, age, sent)
    nu_count = jax.tree.map(lambda c, a, hit: jnp.where(hit, c + a, c), state.nu_count, age,
                            sent)
    sent_at = jax.tree.map(lambda at, hit: jnp.where(hit, count, at), state.sent_at, sent)
    mu = jax.tree.map(lambda new, old: jnp.where(skipped, old, new), new_mu, state.mu)
    out = jax.tree.map(lambda u: jnp.where(skipped, jnp.zeros_like(u), u),
                       _scaled(rates, mu, nu, count, nu_count))
    new = ScaleBySyncedAdamState(count, mu, nu, nu_count, sync_state, sent_at)
    if path == "delayed":  # a delayed sync's first step delivers nothing: no Adam step
      idle = jnp.all(sync_state.count == state.sync.count)
      out = jax.tree.map(lambda u: jnp.where(idle, jnp.zeros_like(u), u), out)
      new = jax.tree.map(lambda a, b: jnp.where(idle, b, a), new._replace(sync=state.sync),
                         state)._replace(sync=sync_state)
    return out, new

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _refresh_due(count: jax.Array, freeze_step: int) -> jax.Array:
  """True at updates ``2 W, 4 W, 8 W, ...`` (``W = freeze_step``): 0/1 Adam's growing
  intervals between refreshes of ``v``."""
  ratio = count // freeze_step
  return (count % freeze_step == 0) & (ratio >= 2) & ((ratio & (ratio - 1)) == 0)


def _refreshed(fresh: jax.Array, grads, mean, axes):
  """At a refresh (``fresh``, the same on every device): the mean of each device's gradient
  ``grads`` over ``axes``, in full precision, in place of ``mean``; elsewhere ``mean``."""
  def dense():
    return jax.tree.map(
        lambda g, m: jax.lax.pmean(g.astype(jnp.float32), axes).astype(m.dtype), grads, mean)

  return jax.lax.cond(fresh, dense, lambda: mean)


def _refresh_bytes(grads, axes) -> float:
  """Bytes one device sends in a refresh's ring all-reduces of ``grads`` in float32."""
  p = math.prod(jax.lax.axis_size(a) for a in axes)
  return float(sum(dense_bytes(p, g.size, 4) for g in jax.tree.leaves(grads)))


def _check_sync(sync, freeze_step: int, sends, second_moment) -> int:
  """:func:`scale_by_synced_adam`'s checks of its sync and modes; returns the sync's delay."""
  if sends not in SENDS:
    raise ValueError(f"scale_by_synced_adam: sends must be one of {SENDS}, got {sends!r}.")
  if second_moment not in SECOND_MOMENTS:
    raise ValueError(f"scale_by_synced_adam: second_moment must be one of {SECOND_MOMENTS}, "
                     f"got {second_moment!r}.")
  if not isinstance(sync, optax.GradientTransformation):
    raise TypeError(f"scale_by_synced_adam: sync must be an optax.GradientTransformation "
                    f"(spardl_jax.spardl, spardl_jax.sync_gradients), got "
                    f"{type(sync).__name__}.")
  if second_moment == "refreshed" and built_with(sync) is None:
    raise ValueError("scale_by_synced_adam: second_moment='refreshed' averages the gradient "
                     "over the sync's data axes at each refresh: the sync must be "
                     "sj.sync_gradients (or sj.spardl, ...) itself, not a chain.")
  warmup = dense_warmup(sync)
  if warmup is not None and warmup < freeze_step:
    raise ValueError(
        f"scale_by_synced_adam: freeze_step={freeze_step}, but the sync's dense warm-up is "
        f"{warmup} steps: v trains on the mean gradient only while the sync is dense; build "
        f"the sync with warmup_steps={freeze_step} (or more)"
        + (f", or lower freeze_step to {warmup}." if warmup else "."))
  options = built_with(sync)
  delayed = 0 if options is None else options.delay
  if delayed and sends != "momentum":
    raise ValueError(f"scale_by_synced_adam: sends={sends!r} with a delayed sync (delay="
                     f"{delayed}): the preconditioner a message is divided by changes "
                     f"before the next step sends it; use sends='momentum' with a delayed "
                     f"sync.")
  return delayed


class _Step(NamedTuple):
  """How one :func:`scale_by_synced_adam` step goes through its sync: the ``path``
  (``"delayed"``, the delayed sync's momentum, or ``sends``), Adam's ``rates``, and whether
  the step is in the ``warm``-up."""

  path: str
  rates: _Rates
  warm: jax.Array


class _Synced(NamedTuple):
  """What the sync's part of a step hands on: what it ``delivered``, its new ``state``, the
  ``mean`` gradient, and the new first moment ``mu``."""

  delivered: Any
  state: Any
  mean: Any
  mu: Any


def _through_sync(send, updates, state, step: _Step) -> _Synced:
  """The sync's part of a :func:`scale_by_synced_adam` step; ``send(x, **extra)`` runs the
  sync's update on ``x`` from its state in ``state``."""
  b1, b2, eps = step.rates
  if step.path == "delayed":
    # The message held for the next step is this step's momentum m_i = b1 m + (1 - b1) g_i
    # with m this step's result, so that one momentum runs through the delayed syncs.
    synced, sync_state = send(updates, next_message=lambda m, g: b1 * m + (1 - b1) * g)
  elif step.path == "momentum":
    synced, sync_state = send(jax.tree.map(
        lambda m, g: (b1 * m + (1 - b1) * g).astype(m.dtype), state.mu, updates))
  if step.path != "preconditioned":
    mean = jax.tree.map(lambda new, old: (new - b1 * old) / (1 - b1), synced, state.mu)
    return _Synced(synced, sync_state, mean, synced)
  # D = 1 in the warm-up (the sync is dense: its result is the mean gradient itself).
  scale = _preconditioner(state.nu, state.nu_count, b2, eps, identity=step.warm)
  synced, sync_state = send(jax.tree.map(lambda g, d: (g / d).astype(g.dtype), updates, scale))
  mean = jax.tree.map(lambda u, d: u * d, synced, scale)
  return _Synced(synced, sync_state, mean, jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g,
                                                        state.mu, mean))


def check_rate_and_decay(who: str, learning_rate, weight_decay) -> None:
  """An optimizer's learning rate (a finite number >= 0, or an optax schedule) and its
  decoupled weight decay (a finite number >= 0), checked before anything is built."""
  if not callable(learning_rate):
    check_number(who, "learning_rate", learning_rate, "a finite number >= 0 or an optax "
                 "schedule", accept=lambda lr: 0 <= lr < float("inf"))
  check_number(who, "weight_decay", weight_decay, "a finite number >= 0",
               accept=lambda wd: 0 <= wd < float("inf"))


def synced_adamw(learning_rate: optax.ScalarOrSchedule, *, warmup_steps: int,
                 density=0.07, method: str = "spardl", b1: float = 0.9, b2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 1e-4, mask=None,
                 sends: Sends = "momentum", second_moment: SecondMoment = "sent",
                 dense_leaves="vectors", **sync_options) -> optax.GradientTransformationExtraArgs:
  """AdamW with a sparse sync inside: the trainer's AdamW recipe as one transformation.

  ``optax.chain(sj.spardl(...), optax.adamw(...))`` normalises a gradient that arrives in
  bursts (a coordinate sent once in a hundred steps carries a hundred steps of residual),
  which Adam's per-coordinate ``v`` undoes. This is instead
  ``scale_by_synced_adam(sync_gradients(method, density=density,
  warmup_steps=warmup_steps, ...), freeze_step=warmup_steps, sends=sends,
  second_moment=second_moment)`` followed by
  AdamW's decoupled weight decay and ``-learning_rate``: plain AdamW on the mean gradient
  for ``warmup_steps`` dense syncs, then Adam's first moment (by default) averaged by the
  sparse sync with its error feedback, and ``v`` trained where the sync delivers (by
  default; ``second_moment="frozen"`` is 1-bit Adam's). Use it in place of the whole
  ``chain(sync, adamw)``; ``update`` runs inside the data-parallel ``jax.shard_map``.

  The defaults are the setting measured best on every AdamW case we ran
  (benchmarks/results/adam.md, 2026-11-29): 7 % of the entries, SparDL's 8-bit wire
  (``wire="int8"``, SparDL's default here; pass ``wire=`` to change it) and biases and norm
  scales averaged densely (``dense_leaves="vectors"``). On nanoGPT's baby GPT at its
  2,000-step horizon it ends 0.7 % above dense AdamW's loss on three seeds at 1/15 of dense's
  bytes over the run; at a 600-step horizon it ends 10 % above (seed 0, 1/15 of the bytes;
  15 % of the entries: 3.6 % above at 1/8): the sparse sync needs the longer run to catch
  up (benchmarks/results/islands.md). Where bytes must fall further, or the run is short,
  an outer loop over islands (:func:`spardl_jax.diloco`) does better.

  Example:

    >>> import jax, jax.numpy as jnp, spardl_jax as sj
    >>> mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    >>> tx = sj.synced_adamw(1e-3, warmup_steps=100, density=0.01, weight_decay=0.01)
    >>> state = sj.init_opt_state(tx, {"w": jnp.zeros((100, 10))}, mesh)
    >>> state[0].sync.method_state.residual.shape
    (8, 1000)

  Args:
    learning_rate: a float or an optax schedule, as ``optax.adamw``'s.
    warmup_steps: dense syncs first, which train ``v`` (an int >= 1). The rule: 1.25 % of
      the run's steps (nanoGPT's 25 of 2,000, the setting measured; the trainer's AdamW
      recipe takes it): each dense step costs a dense step's bytes, and a longer warm-up
      bought little (600 steps: 25 against 8 steps, 2.107 against 2.131).
    density: the sparse method's density (or schedule, or ``"auto"``); a method that
      keeps no fraction of the entries (``"powersgd"``, ``"dense"``) takes none.
    dense_leaves: the leaves averaged densely outside the method
      (:func:`~spardl_jax.sync_gradients`' option; None: every float leaf through it).
    method: a registered method with a density (``"spardl"``, ``"topka"``, ...).
    b1, b2, eps: Adam's.
    weight_decay, mask: AdamW's decoupled weight decay and the mask of the leaves it
      applies to, as ``optax.adamw``'s.
    sends: ``"momentum"`` (1-bit Adam's compression stage) or ``"preconditioned"`` (see
      :func:`scale_by_synced_adam`).
    second_moment: trained where ``"sent"`` after the warm-up, ``"frozen"``, or
      ``"refreshed"`` densely at growing intervals (0/1 Adam's; ibid.).
    **sync_options: :func:`~spardl_jax.sync_gradients`' other options (``axis_name``,
      ``wire``, ``param_specs``, ...).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; its state is a tuple whose first entry is
    the :class:`ScaleBySyncedAdamState`.
  """
  who = "synced_adamw"
  warmup_steps = check_number(who, "warmup_steps", warmup_steps, "an int >= 1",
                              integral=True, accept=lambda s: s >= 1)
  check_rate_and_decay(who, learning_rate, weight_decay)
  if sync_options.get("momentum") is not None:
    raise ValueError(f"{who}: momentum={sync_options['momentum']} (DGC's momentum "
                     f"correction) would put a second momentum inside Adam's: Adam's first "
                     f"moment is what the sync averages; set Adam's b1 instead.")
  if method in names() and is_sparse(method):  # an unknown one: sync_gradients names them
    sync_options["density"] = density
  if method == "spardl":
    sync_options.setdefault("wire", "int8")
  sync = sync_gradients(method, warmup_steps=warmup_steps, dense_leaves=dense_leaves,
                        **sync_options)
  inner = optax.chain(
      scale_by_synced_adam(sync, freeze_step=warmup_steps, b1=b1, b2=b2, eps=eps, sends=sends,
                           second_moment=second_moment),
      optax.add_decayed_weights(weight_decay, mask), optax.scale_by_learning_rate(learning_rate))

  def update_fn(updates, state, params=None, **extra_args):
    if not (isinstance(state, tuple) and len(state) == 3
            and isinstance(state[0], ScaleBySyncedAdamState)):
      got = type(state).__name__
      if isinstance(state, tuple):
        got += f" of {', '.join(type(part).__name__ for part in state)}"
      raise TypeError(f"{who}: state must be what this transformation's init returns (a "
                      f"tuple whose first entry is a ScaleBySyncedAdamState), got {got}; "
                      f"init it with sj.init_opt_state(tx, params, mesh) of this tx.")
    return inner.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)
