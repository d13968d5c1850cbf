"""The optimizer a variant trains with: its gradient sync and the optimizer around or after it,
built from the variant's tuning (:class:`train.config.Tuning`) and the run's flags.

:func:`variant_tuning` fills in what a variant leaves out (the recipe, ``--outer-every``) and
refuses a combination that cannot act (:data:`REFUSALS`, one rule a row);
:func:`make_optimizer` then builds it with the builder of its kind (:data:`BUILDERS`): the sync
chained before SGD or AdamW, Adam around the sync, DeMo, an outer loop, or a delayed sync with
its weight prediction.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

import spardl_jax as sj
from train.config import TrainConfig, Tuning, Variant, recipe_tuning
from train.mesh import ISLAND_AXIS

__all__ = ['make_optimizer', 'learning_rate', 'variant_tuning', 'kind', 'BUILDERS', 'REFUSALS']


def learning_rate(cfg: TrainConfig, peak: float,
                  steps_per_epoch: int | None) -> optax.ScalarOrSchedule:
  """``peak``, or under ``cfg.lr_schedule='cosine'`` a linear warm-up from 0 over
  ``cfg.lr_warmup`` steps and a cosine decay to ``cfg.lr_final * peak`` at the run's end
  (nanoGPT's ``get_lr``)."""
  if cfg.lr_schedule == "constant":
    return peak
  if cfg.lr_schedule != "cosine":
    raise ValueError(f"--lr-schedule must be 'constant' or 'cosine', got {cfg.lr_schedule!r}.")
  if not steps_per_epoch:
    raise ValueError("make_optimizer: lr_schedule='cosine' needs steps_per_epoch.")
  total = cfg.epochs * steps_per_epoch
  if not 0 <= cfg.lr_warmup < total:
    raise ValueError(f"--lr-warmup must be in [0, {total}) (the run's steps), got "
                     f"{cfg.lr_warmup}.")
  if cfg.lr_warmup:
    return optax.warmup_cosine_decay_schedule(0.0, peak, cfg.lr_warmup, total,
                                              end_value=cfg.lr_final * peak)
  return optax.cosine_decay_schedule(peak, total, alpha=cfg.lr_final)


class Refusal(NamedTuple):
  """A combination of tuning keys that cannot act, and what to say: ``when(cfg, method,
  tuning)`` is True for it; ``why`` is the message (a format string of ``cfg``, ``method``
  and ``tuning``)."""

  when: Callable[[TrainConfig, str, Tuning], bool]
  why: str


def _sparse(method: str) -> bool:
  return sj.methods.is_sparse(method)


# Checked in order on the tuning a variant trains with (its own keys, then the recipe's).
REFUSALS: tuple[Refusal, ...] = (
    Refusal(lambda cfg, m, t: t.freeze is not None and cfg.optimizer != "adamw",
            "freeze (Adam's second moment frozen) needs --optimizer adamw, got --optimizer "
            "{cfg.optimizer}."),
    Refusal(lambda cfg, m, t: t.masking is not None and t.momentum is None,
            "masking (DGC's momentum factor masking) needs momentum=M (DGC's momentum "
            "correction) in the same spec."),
    Refusal(lambda cfg, m, t: bool(t.synced) and cfg.optimizer != "adamw",
            "synced (Adam around the sync) needs --optimizer adamw, got --optimizer "
            "{cfg.optimizer}."),
    Refusal(lambda cfg, m, t: bool(t.synced) and (
        not t.warmup or t.momentum is not None or bool(t.outer)
        or t.freeze not in (None, t.warmup)),
            "synced trains Adam's second moment on the mean gradient of a dense warm-up and "
            "freezes it there: it needs warmup=N (N >= 1), and takes no momentum=M (Adam's "
            "first moment is the momentum), no outer=H and no other freeze."),
    Refusal(lambda cfg, m, t: bool(t.second_moment) and not t.synced,
            "second_moment (Adam's v after the warm-up) needs synced=momentum or "
            "synced=preconditioned in the same spec."),
    Refusal(lambda cfg, m, t: bool(t.ramp) and not _sparse(m),
            "ramp (a density warm-up) needs a sparse method with a density; {method!r} has "
            "none."),
    Refusal(lambda cfg, m, t: bool(t.sign) and (
        not _sparse(m) or bool(t.synced) or bool(t.outer) or t.momentum is not None
        or bool(t.freeze) or bool(t.lookahead)),
            "sign=1 (DeMo: the sign of the synced momentum) needs a sparse method with error "
            "feedback ({method!r} given) and takes no synced=, outer=, momentum=, freeze= or "
            "lookahead= (the sync's residual, decayed by decay=, is its momentum)."),
    Refusal(lambda cfg, m, t: bool(t.lookahead) and (not t.delay or bool(t.synced)
                                                     or bool(t.outer)),
            "lookahead (the gradient taken one step ahead) needs delay=1 in the same spec and "
            "the optimizer after the sync: not synced= (Adam around the sync, the AdamW "
            "recipe's) nor outer=H."),
    Refusal(lambda cfg, m, t: (t.fragments is not None or t.overlap is not None)
            and not t.outer,
            "fragments and overlap (Streaming DiLoCo's) need outer=H in the same spec, or "
            "--outer-every H."),
    Refusal(lambda cfg, m, t: t.clip is not None and bool(t.outer),
            "clip (DGC's local clipping of each device's gradient before the sync) with outer=H: "
            "an outer loop's sync sends parameter changes, not gradients; clip the inner "
            "steps with --grad-clip."),
)


def variant_tuning(cfg: TrainConfig, variant: Variant, *,
                   steps_per_epoch: int | None = None) -> Tuning:
  """The :class:`~train.config.Tuning` ``variant`` trains with: its own keys, and for a
  sparse method the recipe ``cfg.recipe`` for what they leave out.

  Raises:
    ValueError: for a key that cannot act here (:data:`REFUSALS`: ``freeze`` without AdamW,
      ``masking`` without ``momentum``, ``ramp`` for a method without a density, ...),
      rather than ignore it.
  """
  tuning = variant.tuning
  every = cfg.outer_every if tuning.outer is None else tuning.outer
  if every:
    tuning = tuning.over(Tuning(outer=every, outer_lr=cfg.outer_lr,
                                outer_momentum=cfg.outer_momentum))
  elif tuning.outer_lr is not None or tuning.outer_momentum is not None:
    raise ValueError("outer_lr and outer_momentum (the outer loop's step) need outer=H "
                     "in the same spec, or --outer-every H.")
  recipe = recipe_tuning(cfg.recipe, optimizer=cfg.optimizer, steps_per_epoch=steps_per_epoch,
                         epochs=cfg.epochs)
  if _sparse(variant.method) and not every:  # the recipe fills in the rest
    if tuning.momentum is not None or tuning.sign:  # a momentum in place of Adam's around
      recipe = recipe._replace(synced=None, second_moment=None)
    if tuning.momentum is not None:  # DGC's velocity is the sparse vector's alone
      recipe = recipe._replace(dense_leaves=None)
    tuning = tuning.over(recipe)
  elif tuning.synced and tuning.second_moment is None:
    # Adam around any other sync (PowerSGD) trains v as the recipe does: v frozen after a
    # short warm-up is one sample of the mean gradient's square, near 0 for some
    # coordinates, whose steps then grow far beyond the learning rate (a loss of 577
    # after two steps with a one-step warm-up).
    tuning = tuning._replace(second_moment=recipe.second_moment)
  for refusal in REFUSALS:
    if refusal.when(cfg, variant.method, tuning):
      raise ValueError(refusal.why.format(cfg=cfg, method=variant.method, tuning=tuning))
  return tuning


class Parts(NamedTuple):
  """What every builder shares: the run's flags, the variant and its tuning, the inner
  optimizer's rate and momentum, nanoGPT's weight-decay mask, the sync's options and the
  devices on the data axis."""

  cfg: TrainConfig
  variant: Variant
  tuning: Tuning
  lr: Any
  momentum: float
  decay_mask: Any
  sync_options: dict
  devices: int
  islands: bool

  def clipped(self, *txs):
    """``txs`` chained, with ``--grad-clip`` before the last of them: dense training clips
    the mean gradient (after the sync), as nanoGPT does; where the optimizer is around the
    sync or inside an outer loop, each device clips its own. No clipping leaves the
    optimizer's structure (and its checkpoints) as it was."""
    if self.cfg.grad_clip is None:
      return txs[0] if len(txs) == 1 else optax.chain(*txs)
    return optax.chain(*txs[:-1], optax.clip_by_global_norm(self.cfg.grad_clip), txs[-1])

  def local_clip(self, tx):
    """``tx`` after DGC's local clipping (``clip=c``): each device rescales its own gradient
    to norm at most ``c / sqrt(P)`` before anything else sees it (the mean of ``P`` such
    gradients has norm at most ``c / sqrt(P)`` under independence, about what a global clip
    at ``c`` allows the sum)."""
    if self.tuning.clip is None:
      return tx
    return optax.chain(optax.clip_by_global_norm(self.tuning.clip / math.sqrt(self.devices)),
                       tx)

  def optimizer(self):
    """SGD with momentum, AdamW, or AdamW with its second moment frozen (``freeze``)."""
    cfg, tuning = self.cfg, self.tuning
    if cfg.optimizer == "sgd":
      return optax.sgd(self.lr, momentum=self.momentum or None)
    if cfg.optimizer == "adamw" and tuning.freeze:
      return optax.chain(sj.adam.scale_by_frozen_adam(freeze_step=tuning.freeze,
                                                      b1=self.momentum, b2=cfg.adam_b2),
                         optax.add_decayed_weights(cfg.weight_decay, self.decay_mask),
                         optax.scale_by_learning_rate(self.lr))
    if cfg.optimizer == "adamw":
      return optax.adamw(self.lr, b1=self.momentum, b2=cfg.adam_b2,
                         weight_decay=cfg.weight_decay, mask=self.decay_mask)
    if cfg.optimizer == "muon":  # MuLoCo's inner optimizer: Muon on matrices, AdamW beside
      return optax.contrib.muon(self.lr, beta=self.momentum, weight_decay=cfg.weight_decay,
                                weight_decay_mask=self.decay_mask, adam_b2=cfg.adam_b2,
                                adam_learning_rate=cfg.adam_lr)
    raise ValueError(f"--optimizer must be 'sgd', 'adamw' or 'muon', got {cfg.optimizer!r}.")

  def sync(self, **options):
    """The variant's gradient sync (``options`` over its own), with DGC's momentum
    correction where asked."""
    tuning = self.tuning
    return sj.sync_gradients(self.variant.method, warmup_steps=tuning.warmup or 0,
                             momentum=tuning.momentum, momentum_masking=tuning.masking != 0,
                             **{**self.sync_options, **options})


def _chained(parts: Parts):
  """The sync, then the optimizer: what the paper and dense training do."""
  return parts.local_clip(parts.clipped(parts.sync(), parts.optimizer()))


def _synced_adam(parts: Parts):
  """Adam around the sync (:func:`spardl_jax.synced_adamw`): the sync averages Adam's first
  moment or its preconditioned gradient."""
  cfg, tuning, options = parts.cfg, parts.tuning, dict(parts.sync_options)
  # The density, wire and dense leaves are the spec's, the flags' or the recipe's
  # (RECIPE_OPTIONS, RECIPES): synced_adamw's own defaults never fill them in, so that
  # --recipe paper with synced= keeps SparDL's wire and every leaf through the method.
  if parts.variant.method == "spardl":
    options.setdefault("wire", sj.collectives.SparDLConfig.wire)
  return parts.local_clip(parts.clipped(sj.synced_adamw(
      parts.lr, warmup_steps=tuning.warmup or 0, method=parts.variant.method,
      b1=parts.momentum, b2=cfg.adam_b2, weight_decay=cfg.weight_decay, mask=parts.decay_mask,
      sends=tuning.synced, second_moment=tuning.second_moment or "frozen",
      **{"dense_leaves": None, **options})))


def _demo(parts: Parts):
  """DeMo (:func:`spardl_jax.demo`) in place of the optimizer: ``decay=`` is its momentum's
  decay (``sj.demo``'s default where not given); it takes ``--optimizer``'s rate and weight
  decay, not its moments, and says so."""
  if parts.cfg.optimizer != "sgd":
    logging.getLogger("train").info(
        "%s: sign=1 trains DeMo (the sign of the synced momentum) in place of --optimizer "
        "%s, with its --lr and --weight-decay", parts.variant.label, parts.cfg.optimizer)
  options = dict(parts.sync_options)
  decay = options.pop("residual_decay")
  cfg = parts.cfg
  return parts.local_clip(parts.clipped(sj.demo(
      parts.lr, method=parts.variant.method, weight_decay=cfg.weight_decay,
      mask=parts.decay_mask, warmup_steps=parts.tuning.warmup or 0, **options,
      **({} if decay is None else {"decay": decay}))))


def _outer(parts: Parts):
  """DiLoCo (:func:`spardl_jax.diloco`): the optimizer alone on each replica for ``outer``
  steps, then the mean parameter change through the sync and an outer Nesterov step."""
  tuning = parts.tuning
  outer = optax.sgd(tuning.outer_lr, momentum=tuning.outer_momentum or None,
                    nesterov=bool(tuning.outer_momentum))
  inner = parts.clipped(parts.optimizer())
  sync = parts.sync()
  if parts.islands:  # each island averages its gradient inside, every step; the outer
    # sync crosses the islands, each device its slice (no hierarchical sync there)
    data = parts.cfg.axis_name
    inner = optax.chain(sj.sync_gradients("dense", axis_name=data), inner)
    options = dict(parts.sync_options, local_axis=None)
    sync = sj.sync_gradients(parts.variant.method, warmup_steps=tuning.warmup or 0,
                             momentum=tuning.momentum, momentum_masking=tuning.masking != 0,
                             **options)
  return sj.diloco(inner, sync, every=tuning.outer, outer=outer,
                   fragments=tuning.fragments or 1, overlap=tuning.overlap or 0)


def _predicted(parts: Parts):
  """A delayed sync whose step takes its gradient ahead (:func:`spardl_jax.weight_prediction`,
  by the fraction ``lookahead``)."""
  return parts.local_clip(sj.weight_prediction(parts.sync(), parts.clipped(parts.optimizer()),
                                               scale=parts.tuning.lookahead))


def kind(tuning: Tuning) -> str:
  """The builder (:data:`BUILDERS`) a tuning takes."""
  if tuning.sign:
    return "demo"
  if tuning.synced:
    return "synced_adam"
  if tuning.outer:
    return "outer"
  if tuning.lookahead:
    return "predicted"
  return "chained"


BUILDERS: dict[str, Callable[[Parts], optax.GradientTransformation]] = {
    "chained": _chained, "synced_adam": _synced_adam, "demo": _demo, "outer": _outer,
    "predicted": _predicted}


def make_optimizer(cfg: TrainConfig, variant: Variant, *, steps_per_epoch: int | None = None,
                   specs=None, devices: int = 1,
                   islands: bool = False) -> optax.GradientTransformation:
  """The variant's gradient sync and the optimizer (``cfg.optimizer``: SGD with momentum or
  AdamW), as its tuning says (:func:`variant_tuning`; for a sparse method, what it leaves
  out comes from the recipe ``cfg.recipe``, whose lengths in epochs need
  ``steps_per_epoch``), built by its kind's builder (:data:`BUILDERS`):

  * ``chained``: the sync, then the optimizer, which sees the synchronized gradient (its
    state stays replicated); the sync's dense warm-up (``warmup``), DGC's density warm-up
    (``ramp``), momentum correction (``momentum``, ``masking``: the optimizer after it then
    has no momentum, AdamW's ``b1`` is 0) and local clipping (``clip``, before the sync, at
    ``clip / sqrt(devices)``); ``freeze`` (AdamW) stops the second moment after that many
    steps (:func:`spardl_jax.adam.scale_by_frozen_adam`);
  * ``synced_adam`` (``synced``, AdamW): Adam around the sync
    (:func:`spardl_jax.synced_adamw`): ``momentum``, the sync averages Adam's first moment;
    ``preconditioned``, the gradient divided by Adam's frozen ``sqrt(v) + eps``; the second
    moment trains on the dense warm-up's mean gradient, then stays frozen or, with
    ``second_moment=sent``, trains where the sync delivers;
  * ``demo`` (``sign=1``): DeMo in place of the optimizer (:func:`spardl_jax.demo`);
  * ``outer`` (``outer=H``, or ``--outer-every H``): the optimizer alone on each device for
    ``H`` steps, then the mean parameter change through the sync and an outer Nesterov step
    (:func:`spardl_jax.diloco`);
  * ``predicted`` (``delay=1:lookahead=F``): the step takes its gradient ahead, by the
    fraction ``F`` of each device's estimate of the sync in flight
    (:func:`spardl_jax.weight_prediction`).

  Every kind takes ``dense_leaves`` (leaves averaged densely beside the method), ``delay=1``
  (each step syncs the gradient of the step before), ``balance=leaves`` and ``decay``
  (SparseLoCo's decayed error feedback) as the sync's options. For SGD without an explicit
  ``lr`` the rate is rescaled to keep ``lr / (1 - momentum)``, the step a steady gradient
  reaches, equal to ``--lr``'s with ``--momentum``: lowering the momentum then changes only how
  much past gradient the optimizer replays, which is what a residual wants.
  ``cfg.lr_schedule='cosine'`` decays the rate over the run. ``specs`` are the parameters'
  specs on a mesh of several axes, for the sync; ``devices`` the devices on the data axes.
  On an islands mesh (``islands``, ``--islands M``) every sync reduces over the island axis:
  an every-step sync dense inside each island and the method across (``local_axis``, a
  hierarchical sync); an outer loop's replicas are the islands, each averaging its gradient
  densely inside every inner step.
  """
  tuning = variant_tuning(cfg, variant, steps_per_epoch=steps_per_epoch)
  corrected = tuning.momentum is not None
  default_momentum = {"sgd": cfg.momentum, "muon": 0.95}.get(cfg.optimizer, 0.9)
  momentum = 0.0 if corrected else (default_momentum if tuning.opt_momentum is None
                                    else tuning.opt_momentum)
  lr = cfg.lr if tuning.lr is None else tuning.lr
  if cfg.optimizer == "sgd" and tuning.lr is None and tuning.opt_momentum is not None:
    lr = cfg.lr * (1 - momentum) / (1 - cfg.momentum)
  # nanoGPT's configure_optimizers: no decay on biases and norm scales.
  decay_mask = (None if cfg.weight_decay_on == "all"
                else lambda params: jax.tree.map(lambda x: x.ndim >= 2, params))
  options = dict(variant.options)
  if tuning.ramp:
    options["density"] = sj.density_warmup(options["density"], steps=tuning.ramp,
                                           at=tuning.warmup or 0)
  sync_options = dict(axis_name=cfg.axis_name, residual_decay=tuning.decay,
                      param_specs=specs, **options)
  if islands:
    sync_options.update(axis_name=ISLAND_AXIS, local_axis=cfg.axis_name)
  if tuning.dense_leaves:
    sync_options["dense_leaves"] = (tuning.dense_leaves if tuning.dense_leaves == "vectors"
                                    else int(tuning.dense_leaves))
  for key in ("delay", "balance"):
    if getattr(tuning, key):
      sync_options[key] = getattr(tuning, key)
  parts = Parts(cfg, variant, tuning, learning_rate(cfg, lr, steps_per_epoch), momentum,
                decay_mask, sync_options, devices, islands)
  return BUILDERS[kind(tuning)](parts)
