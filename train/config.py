"""Training configuration: the defaults are the main job (MNIST-1D, 8 devices, dense vs SparDL 1 %)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
import typing
from typing import Any, Literal, NamedTuple

from models.registry import Size
import spardl_jax as sj


# Argument types of the command lines (the trainer's, and the benchmarks' that run it).
def bounded(kind, low, *, above: bool = False, what: str = ""):
  """An argparse type: ``kind`` values ``>= low`` (``> low`` with ``above``) and finite."""
  def parse(text):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not {what or kind.__name__}") from None
    if value != value or value in (float("inf"), float("-inf")) or value < low or (
        above and value == low):
      raise argparse.ArgumentTypeError(
          f"must be {'>' if above else '>='} {low}{' and finite' if kind is float else ''}, "
          f"got {text}")
    return value
  parse.__name__ = what or kind.__name__
  return parse


POSITIVE_INT = bounded(int, 1, what="a positive int")
NON_NEGATIVE_INT = bounded(int, 0, what="an int >= 0")
POSITIVE_FLOAT = bounded(float, 0.0, above=True, what="a positive number")
NON_NEGATIVE_FLOAT = bounded(float, 0.0, what="a number >= 0")


def UNIT_FLOAT(text):
  """An argparse type: a number in [0, 1)."""
  value = NON_NEGATIVE_FLOAT(text)
  if value >= 1:
    raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
  return value


class Tuning(NamedTuple):
  """A variant's options beyond its method's own (``spardl:warmup=93:momentum=0.9``): how
  the sync converges and the optimizer after it (see ``make_optimizer`` in
  train/train.py). None leaves a key to the recipe (sparse methods) or to the flags."""

  warmup: int | None = None          # dense syncs first (sync_gradients' warmup_steps)
  ramp: int | None = None            # steps of DGC's density warm-up after the dense one
  momentum: float | None = None      # DGC momentum correction before the sync (SGD: none after)
  masking: int | None = None         # DGC momentum factor masking, 0 or 1 (default 1)
  clip: float | None = None          # DGC local gradient clipping threshold
  lr: float | None = None            # this variant's learning rate (default: --lr)
  opt_momentum: float | None = None  # this variant's SGD momentum or AdamW b1
  freeze: int | None = None          # AdamW: freeze the second moment after N steps
  outer: int | None = None           # DiLoCo's H: inner steps per synced outer step (0: off)
  outer_lr: float | None = None      # the outer Nesterov step's rate (default --outer-lr)
  outer_momentum: float | None = None  # its momentum (default --outer-momentum)
  decay: float | None = None         # SparseLoCo's error-feedback decay (residual_decay)
  synced: str | None = None          # AdamW: sync Adam's "momentum" or "preconditioned" gradient
  second_moment: str | None = None   # with synced: v "frozen", trained where "sent", "refreshed"
  dense_leaves: str | None = None    # leaves averaged densely outside the method: "vectors" or N entries
  delay: int | None = None           # 1: each step syncs the last step's gradient (overlap)
  lookahead: float | None = None     # with delay=1: the gradient taken ahead, by this fraction
  balance: str | None = None         # "leaves": each leaf scaled to the vector's size before top-k
  sign: int | None = None            # 1: DeMo, the sign of the synced momentum (sj.demo)
  fragments: int | None = None       # with outer=H: the parameters synced in F staggered parts
  overlap: int | None = None         # with outer=H: the outer update lands this many steps late

  def given(self) -> dict[str, Any]:
    """The keys set, by name."""
    return {k: v for k, v in self._asdict().items() if v is not None}

  def over(self, defaults: "Tuning") -> "Tuning":
    """``defaults`` with the keys set here in their place."""
    return defaults._replace(**self.given())


class Rule(NamedTuple):
  """What one tuning key accepts: its type, and the values it allows (in words, as a check)."""

  kind: type
  allowed: str
  ok: Callable[[Any], bool]


_AT_LEAST_0 = Rule(int, ">= 0", lambda v: v >= 0)
_UNIT = Rule(float, "in [0, 1)", lambda v: 0 <= v < 1)
_POSITIVE = Rule(float, "> 0 and finite", lambda v: 0 < v < float("inf"))
TUNING: dict[str, Rule] = {
    "warmup": _AT_LEAST_0, "ramp": _AT_LEAST_0, "momentum": _UNIT,
    "masking": Rule(int, "0 or 1", lambda v: v in (0, 1)), "clip": _POSITIVE, "lr": _POSITIVE,
    "opt_momentum": _UNIT, "freeze": Rule(int, ">= 1", lambda v: v >= 1),
    "outer": _AT_LEAST_0, "outer_lr": _POSITIVE, "outer_momentum": _UNIT,
    "decay": Rule(float, "in [0, 1]", lambda v: 0 <= v <= 1),
    **{key: Rule(str, " or ".join(map(repr, choices)), lambda v, c=choices: v in c)
       for key, choices in (("synced", sj.options.SENDS),
                            ("second_moment", sj.options.SECOND_MOMENTS))},
    "dense_leaves": Rule(str, "'vectors' or an int N >= 1 (leaves of fewer than N entries)",
                         lambda v: v == "vectors" or (v.isdigit() and int(v) >= 1)),
    "delay": Rule(int, "0 or 1", lambda v: v in (0, 1)),
    "lookahead": Rule(float, "in [0, 1]", lambda v: 0 <= v <= 1),
    "balance": Rule(str, " or ".join(map(repr, sj.options.BALANCES)),
                    lambda v: v in sj.options.BALANCES),
    "sign": Rule(int, "0 or 1", lambda v: v in (0, 1)),
    "fragments": Rule(int, ">= 1", lambda v: v >= 1), "overlap": _AT_LEAST_0}
assert tuple(TUNING) == Tuning._fields, "a rule for every tuning key"


@dataclasses.dataclass(frozen=True)
class Variant:
  """One gradient-sync method to train with.

  Attributes:
    label: the name in tables and plots, e.g. ``spardl:density=0.001``.
    method: a registered method's name (:func:`spardl_jax.methods.names`).
    options: the method's options (``density``, ``teams``, ``residuals`` for SparDL).
    tuning: its :class:`Tuning` (sync warm-ups, momentum correction, clipping, and the
      optimizer's learning rate and momentum for this variant).
  """

  label: str
  method: str
  options: dict
  tuning: Tuning = Tuning()

  @property
  def spec(self) -> sj.options.MethodSpec:
    """The method and its options, as :func:`spardl_jax.options.parse` reads a spec."""
    return sj.options.MethodSpec(self.method, self.options)


Optimizer = Literal["sgd", "adamw", "muon"]
LrSchedule = Literal["constant", "cosine"]
DecayOn = Literal["all", "matrices"]
OPTIMIZERS: tuple[str, ...] = typing.get_args(Optimizer)
DECAY_ON: tuple[str, ...] = typing.get_args(DecayOn)
LR_SCHEDULES: tuple[str, ...] = typing.get_args(LrSchedule)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """One run's settings; the trainer's flags are its fields (``--batch-size`` is
  ``batch_size``) and take their defaults from here."""

  model: str = "cnn1d"
  model_size: Size = "full"
  dataset: str = "mnist1d"
  variants: tuple[Variant, ...] = ()
  devices: int | None = None  # None: every device (8 simulated CPU devices in one process)
  # (axis, size) pairs of a mesh of several axes, the data axis among them: the parameters
  # are sharded over the others (FSDP). (): one data axis over --devices.
  mesh: tuple[tuple[str, int], ...] = ()
  # Islands: M groups of devices/M, the batch split over both; every step's sync is then
  # dense inside an island and the method across (a hierarchical sync), and an outer loop's
  # replicas are the islands, each averaging its gradient inside every step. 1: none.
  islands: int = 1
  epochs: int = 30
  batch_size: int = 128
  lr: float = 0.05
  momentum: float = 0.9  # SGD's
  lr_schedule: LrSchedule = "constant"  # or "cosine" (to lr_final * lr over the run)
  lr_warmup: int = 0  # cosine: steps of a linear warm-up from 0 before the decay (nanoGPT's)
  lr_final: float = 0.0  # cosine: the rate at the run's end, a fraction of the peak
  recipe: str = "recommended"  # tuning defaults of sparse variants (RECIPES); "paper": none
  optimizer: Optimizer = "sgd"  # or "adamw" (BERT)
  weight_decay: float = 0.01  # AdamW's
  weight_decay_on: DecayOn = "all"  # or "matrices": leaves of 2 or more dimensions (nanoGPT's)
  adam_b2: float = 0.999  # AdamW's second-moment decay
  adam_lr: float | None = None  # Muon's AdamW rate for the leaves that are no matrix (None: lr)
  # The global norm the synchronized gradient is clipped to before the optimizer (nanoGPT's
  # grad_clip); None: no clipping. Adam around the sync clips each device's gradient.
  grad_clip: float | None = None
  seed: int = 0
  out: str = "train_out"
  axis_name: str = "data"
  data_dir: str | None = None
  seq_len: int | None = None  # None: the model's (256 IMDB, 35 PTB, 128 BERT)
  image_size: int = 224  # ImageNet crops
  steps_per_epoch: int | None = None  # None: one pass over the training set
  eval_steps: int | None = None  # None: the whole test set
  log_every: int = 50  # steps between fetches of the metrics to the host
  data_workers: int = 0  # Grain worker processes that read and decode batches (0: a thread)
  checkpoint_every: int | None = None  # steps between checkpoints inside an epoch
  # The outer loop (spardl_jax.diloco): each device trains alone for outer_every steps, then
  # the method syncs the parameter change and a Nesterov step applies it. 0: every step.
  # DiLoCo's lr with half its momentum: its 0.9 diverged on the main job with SGD and
  # momentum inside (benchmarks/results/outer.md).
  outer_every: int = 0
  outer_lr: float = 0.7
  outer_momentum: float = 0.5


def parse_variant(text: str, *, recipe: Mapping[str, Mapping[str, Any]] | None = None,
                  **flags) -> Variant:
  """``method[:key=value...]`` -> :class:`Variant`.

  Keys of :data:`TUNING` are the variant's tuning; the others are the method's options (see
  :func:`spardl_jax.options.parse`). Options not in ``text`` come from ``flags`` (the
  trainer's ``--density``, ``--teams``, ``--sag``, ``--residuals``; None: not given), then
  from ``recipe`` (method -> options, :data:`RECIPE_OPTIONS`) unless the spec runs its own
  outer loop, then from :data:`OPTION_DEFAULTS`; tuning not in ``text`` from the recipe
  (``TrainConfig.recipe``) for sparse methods, when the run starts.
  """
  method, pairs = sj.options.split_spec(text)
  tuning, rest = {}, [method]
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if sep and key in TUNING:
      rule = TUNING[key]
      try:
        tuning[key] = rule.kind(value)
      except ValueError:
        raise ValueError(f"method spec {text!r}: {key}={value!r} is not a valid "
                         f"{rule.kind.__name__}.") from None
      if not rule.ok(tuning[key]):
        raise ValueError(f"method spec {text!r}: {key} must be {rule.allowed}, got {value}.")
    else:
      rest.append(pair)
  by_recipe = {} if recipe is None or "outer" in tuning else recipe.get(method, {})
  given = {key: value for key, value in flags.items() if value is not None}
  method, options = sj.options.parse(":".join(rest), **{**OPTION_DEFAULTS, **by_recipe, **given})
  return Variant(text, method, options, Tuning(**tuning))


# The method options --compare's specs, the recipe and the trainer's --density, --teams,
# --sag and --residuals leave out.
OPTION_DEFAULTS: dict[str, Any] = {
    "density": 0.01, **{f.name: f.default for f in dataclasses.fields(sj.collectives.SparDLConfig)
                        if f.name in ("teams", "sag", "residuals")}}


def parse_variants(texts: list[str], *, recipe: Mapping[str, Mapping[str, Any]] | None = None,
                   **flags) -> tuple[Variant, ...]:
  """Every spec of a ``--compare`` list as a :class:`Variant` (:func:`parse_variant` with
  ``recipe`` and ``flags``), each method built once so a bad option fails now, before any
  training. A ValueError names the spec."""
  if not texts:
    raise ValueError("--compare needs at least one method, e.g. 'dense,spardl'.")
  variants = []
  for text in texts:
    variant = parse_variant(text, recipe=recipe, **flags)
    try:
      # A density picked from the devices (density=auto) is picked by the sync itself; any
      # device count checks the other options here.
      variant.spec.build(p=2)
    except (ValueError, TypeError) as error:
      raise ValueError(f"--compare {text!r}: {error}") from None
    variants.append(variant)
  labels = [v.label for v in variants]
  twice = sorted({label for label in labels if labels.count(label) > 1})
  if twice:
    raise ValueError(f"--compare lists {', '.join(map(repr, twice))} more than once; each "
                     f"variant runs once (its results and checkpoints are kept by its spec).")
  return tuple(variants)


# Tuning defaults of the sparse variants, by recipe and optimizer (``--recipe``); lengths in
# epochs. ``recommended`` is what converged fastest within a tenth of dense's bytes
# (docs/trainer.md, benchmarks/results/adam.md); ``paper`` is the plain SparDL of the paper,
# for the ablation. SGD: the residual already stores past gradient, so the optimizer replays
# less of it (momentum 0.5 at the same lr / (1 - momentum)). AdamW: Adam around the sync, as
# in 1-bit Adam's compression stage: a short dense warm-up trains Adam's second moment on the
# mean gradient, then the sync averages Adam's first moment (with its error feedback) in place
# of the gradient, the second moment trains on what the sync delivers, and the 1-D leaves
# (biases, norm scales) are averaged densely beside the sync.
RECIPES: dict[str, dict[str, dict[str, float | str]]] = {
    "recommended": {"sgd": {"opt_momentum": 0.5},
                    "adamw": {"warmup_run": 0.0125, "synced": "momentum",
                              "second_moment": "sent", "dense_leaves": "vectors"},
                    "muon": {}},  # Muon has no recipe around a sync: outer loops only
    "paper": {"sgd": {}, "adamw": {}, "muon": {}},
}
# The method options of each recipe, by optimizer and method, where neither the spec nor a
# flag gives them. AdamW: SparDL at 7 % with 8-bit values, the finalist that met issue 46's
# targets on nanoGPT (1/15 of dense's bytes; benchmarks/results/adam.md); other sparse
# methods keep --density's default, whose bytes 7 % would multiply by 7.
RECIPE_OPTIONS: dict[str, dict[str, dict[str, dict[str, Any]]]] = {
    "recommended": {"sgd": {}, "adamw": {"spardl": {"density": 0.07, "wire": "int8"}},
                    "muon": {}},
    "paper": {"sgd": {}, "adamw": {}, "muon": {}},
}
_EPOCH_KEYS = {"warmup_epochs": "warmup", "ramp_epochs": "ramp", "freeze_epochs": "freeze"}
# Lengths as a fraction of the run's steps: the AdamW recipe's dense warm-up, the one rule
# sj.synced_adamw's docstring states (1.25 %: nanoGPT's 25 of 2,000 steps).
_RUN_KEYS = {"warmup_run": "warmup"}


def recipe_tuning(name: str, *, optimizer: str, steps_per_epoch: int | None,
                  epochs: int | None = None) -> Tuning:
  """The :class:`Tuning` of recipe ``name`` for ``optimizer``, lengths in epochs or in
  fractions of the run turned into steps (at least one; ``steps_per_epoch`` and ``epochs``
  may be None only for a recipe without such lengths)."""
  if name not in RECIPES:
    raise ValueError(f"--recipe must be one of {sorted(RECIPES)}, got {name!r}.")
  tuning = {}
  for key, value in RECIPES[name][optimizer].items():
    if key in _EPOCH_KEYS or key in _RUN_KEYS:
      if steps_per_epoch is None or (key in _RUN_KEYS and epochs is None):
        raise ValueError(f"recipe {name!r} has lengths in steps ({key}): pass "
                         f"steps_per_epoch" + (" and epochs." if key in _RUN_KEYS else "."))
      steps = steps_per_epoch * (epochs if key in _RUN_KEYS else 1)
      tuning[{**_EPOCH_KEYS, **_RUN_KEYS}[key]] = max(1, round(float(value) * steps))
    else:
      tuning[key] = value
  return Tuning(**tuning)


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
  """``--mesh data=4,model=2`` -> ``(("data", 4), ("model", 2))``."""
  axes: list[tuple[str, int]] = []
  for part in text.split(","):
    name, _, size = part.partition("=")
    if not name.isidentifier() or not size.isdigit() or int(size) < 1:
      raise argparse.ArgumentTypeError(
          f"{text!r}: give the mesh as axis=size pairs, e.g. data=4,model=2 (bad part {part!r})")
    if name in dict(axes):
      raise argparse.ArgumentTypeError(f"{text!r}: the axis {name!r} is given twice")
    axes.append((name, int(size)))
  return tuple(axes)
