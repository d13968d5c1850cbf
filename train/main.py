"""Command line of the trainer. With no flags it runs the main job: a 1-D CNN on MNIST-1D on
8 simulated CPU devices, dense all-reduce against SparDL at 1 %, and prints both accuracies."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import sys

import jax

from models import MODELS, describe
from models.registry import SIZES
import spardl_jax as sj
from train.config import (DECAY_ON, LR_SCHEDULES, NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, OPTIMIZERS,
                          OPTION_DEFAULTS, POSITIVE_FLOAT, POSITIVE_INT, RECIPE_OPTIONS, RECIPES,
                          TUNING, UNIT_FLOAT, TrainConfig, parse_mesh, parse_variants)
from train.data import DATASETS

log = logging.getLogger("train")
SIMULATED_DEVICES = 8  # a single CPU process without --devices simulates this many


class UsageError(ValueError):
  """A flag value the trainer cannot run with; printed as one line (``--debug``: a trace)."""


def _density(text: str):
  """``--density``: a number in (0, 1] or ``auto`` (the same words a spec's density=
  takes)."""
  try:
    value = sj.options.parse_density(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number in (0, 1] or 'auto'") from None
  if value != sj.options.AUTO and not 0 < value <= 1:
    raise argparse.ArgumentTypeError(f"must be in (0, 1] or 'auto', got {text}")
  return value


def _parse_args(argv):
  d = TrainConfig()
  p = argparse.ArgumentParser(prog="python -m train", description=__doc__)
  p.add_argument("--model", default=d.model,
                 help=f"one of {', '.join(MODELS)} (default: %(default)s)")
  p.add_argument("--model-size", default=d.model_size, choices=SIZES,
                 help="full: the paper's sizes; tiny: the same structure, a few thousand "
                      "parameters (default: %(default)s)")
  p.add_argument("--describe", action="store_true",
                 help="print the model's layers and parameter count and exit (no training)")
  p.add_argument("--dataset", default=d.dataset,
                 help=f"one of {', '.join(DATASETS)} or wikipedia/<config> "
                      "(default: %(default)s); see train/input_pipeline.py")
  p.add_argument("--data-dir", default=d.data_dir,
                 help="prepared data: the TFDS data directory, the PTB text files, or the "
                      "House dataset")
  p.add_argument("--seq-len", type=POSITIVE_INT, default=d.seq_len,
                 help="tokens per example for text (default: the model's, e.g. 35 for PTB)")
  p.add_argument("--image-size", type=POSITIVE_INT, default=d.image_size,
                 help="ImageNet crop side (default: %(default)s)")
  p.add_argument("--method", default=None,
                 help="one gradient sync to train with, e.g. spardl or dense; overrides --compare")
  p.add_argument("--compare", default="dense,spardl",
                 help="comma list of methods to run on the same data and seed, each "
                      "method[:key=value...] with the method's options and the tuning keys "
                      f"{', '.join(TUNING)}, e.g. 'dense,spardl,spardl:density=0.001,"
                      "spardl:warmup=31:momentum=0.9' (default: %(default)s)")
  p.add_argument("--density", type=_density, default=None,
                 help="the sparse methods' density, in (0, 1], or 'auto' (picked from the "
                      "devices, sj.density_rule) (default: the recipe's, 0.07 for SparDL "
                      f"with AdamW; else {OPTION_DEFAULTS['density']})")
  p.add_argument("--teams", type=sj.options.parse_teams, default=None,
                 help="SparDL teams d, or 'auto' for the alpha-beta model's pick (default 1)")
  p.add_argument("--sag", default=None, choices=sj.options.SAG_MODES,
                 help="Spar-All-Gather for teams > 1 (default: R-SAG when d is a power of two)")
  p.add_argument("--residuals", default=None, choices=sj.options.RESIDUAL_MODES,
                 help=f"where SparDL's residuals go (default: {OPTION_DEFAULTS['residuals']})")
  p.add_argument("--devices", type=POSITIVE_INT, default=d.devices,
                 help="devices on the data axis (default: all devices of the job; in one "
                      "CPU process, 8 simulated devices)")
  p.add_argument("--mesh", type=parse_mesh, default=d.mesh,
                 help="a mesh of several axes, e.g. data=4,model=2: data parallelism over "
                      "'data' (the sync), the parameters sharded FSDP-style over the other "
                      "axes (default: one data axis over --devices)")
  p.add_argument("--islands", type=POSITIVE_INT, default=d.islands,
                 help="M groups of --devices/M devices (a mesh island=M, data=devices/M, the "
                      "batch over both): every step's sync dense inside an island and the "
                      "method across; an outer loop's replicas are the islands (default 1)")
  p.add_argument("--epochs", type=POSITIVE_INT, default=d.epochs)
  p.add_argument("--batch-size", type=POSITIVE_INT, default=d.batch_size, help="global batch size")
  p.add_argument("--steps-per-epoch", type=POSITIVE_INT, default=d.steps_per_epoch,
                 help="cap on train steps per epoch (default: one pass over the data)")
  p.add_argument("--eval-steps", type=POSITIVE_INT, default=d.eval_steps,
                 help="cap on test batches per evaluation (default: the whole test set)")
  p.add_argument("--lr", type=POSITIVE_FLOAT, default=d.lr)
  p.add_argument("--optimizer", default=d.optimizer, choices=OPTIMIZERS,
                 help="applied to the synchronized gradient (default: %(default)s)")
  p.add_argument("--momentum", type=NON_NEGATIVE_FLOAT, default=d.momentum, help="SGD momentum")
  p.add_argument("--lr-schedule", default=d.lr_schedule, choices=LR_SCHEDULES,
                 help="constant, or cosine decay to --lr-final over the run, after "
                      "--lr-warmup steps (default: %(default)s)")
  p.add_argument("--recipe", default=d.recipe, choices=sorted(RECIPES),
                 help="tuning defaults of the sparse methods (a variant's own keys win): "
                      "'recommended' converges fastest (docs/trainer.md), 'paper' is plain "
                      "SparDL (default: %(default)s)")
  p.add_argument("--outer-every", type=NON_NEGATIVE_INT, default=d.outer_every,
                 help="sync every H steps in a DiLoCo outer loop: each device trains alone, "
                      "then the method averages the parameter change and a Nesterov step "
                      "applies it; a variant's outer=H overrides it (default 0: sync every "
                      "step)")
  p.add_argument("--outer-lr", type=POSITIVE_FLOAT, default=d.outer_lr,
                 help="the outer Nesterov step's rate (default %(default)s, DiLoCo's)")
  p.add_argument("--outer-momentum", type=NON_NEGATIVE_FLOAT, default=d.outer_momentum,
                 help="the outer step's Nesterov momentum, in [0, 1) (default %(default)s; "
                      "DiLoCo's 0.9 diverged on the main job, benchmarks/results/outer.md)")
  p.add_argument("--weight-decay", type=NON_NEGATIVE_FLOAT, default=d.weight_decay, help="AdamW decay")
  p.add_argument("--weight-decay-on", default=d.weight_decay_on, choices=DECAY_ON,
                 help="the leaves AdamW decays: all, or matrices (2 or more dimensions; no "
                      "biases or norm scales, as nanoGPT) (default: %(default)s)")
  p.add_argument("--adam-b2", type=UNIT_FLOAT, default=d.adam_b2,
                 help="AdamW's second-moment decay, in [0, 1) (default: %(default)s)")
  p.add_argument("--adam-lr", type=POSITIVE_FLOAT, default=d.adam_lr,
                 help="--optimizer muon: the AdamW rate of the leaves that are no matrix "
                      "(default: --lr)")
  p.add_argument("--grad-clip", type=POSITIVE_FLOAT, default=d.grad_clip,
                 help="clip the gradient to this global norm before the optimizer: the mean "
                      "gradient after a sync, each device's own where Adam is around the "
                      "sync (default: no clipping)")
  p.add_argument("--lr-warmup", type=NON_NEGATIVE_INT, default=d.lr_warmup,
                 help="with --lr-schedule cosine, steps of a linear warm-up from 0 "
                      "(default: %(default)s)")
  p.add_argument("--lr-final", type=UNIT_FLOAT, default=d.lr_final,
                 help="with --lr-schedule cosine, the final rate as a fraction of --lr, in "
                      "[0, 1) (default: %(default)s)")
  p.add_argument("--seed", type=int, default=d.seed)
  p.add_argument("--out", default=d.out, help="directory for metrics and the plot")
  p.add_argument("--checkpoint", action="store_true",
                 help="save the train state (residuals included) after every epoch under "
                      "OUT/checkpoints/METHOD and resume from the newest readable one")
  p.add_argument("--data-workers", type=NON_NEGATIVE_INT, default=d.data_workers,
                 help="Grain worker processes that read and decode training batches "
                      "(default: %(default)s, one reader thread)")
  p.add_argument("--log-every", type=POSITIVE_INT, default=d.log_every,
                 help="steps between fetches of the metrics from the devices (default: "
                      "%(default)s; each epoch's end fetches too)")
  p.add_argument("--checkpoint-every", type=POSITIVE_INT, default=d.checkpoint_every,
                 help="with --checkpoint, also save every N train steps inside an epoch "
                      "(default: at epoch ends only)")
  p.add_argument("--no-progress", action="store_true",
                 help="no progress bar (one appears only on a terminal: steps done of the total, "
                      "steps a second, time left)")
  p.add_argument("--debug", action="store_true",
                 help="on an error, print the full traceback instead of one line")
  p.add_argument("--distributed", action="store_true",
                 help="join a multi-host job detected by jax.distributed.initialize() "
                      "(SLURM, Open MPI, ...); python -m spardl_jax.launch needs no flag")
  return p.parse_args(argv)


def main(argv=None) -> int:
  """Runs the trainer; a bad flag, dataset or checkpoint is one line on stderr (exit 2)."""
  args = _parse_args(argv)
  try:
    return run(args)
  # UsageError is a ValueError; a checkpoint or a file that cannot be written an OSError.
  except (ValueError, TypeError, OSError, ModuleNotFoundError) as error:
    if args.debug:
      raise
    print(f"python -m train: error: {error}", file=sys.stderr)
    return 2


def _variants(args) -> tuple:
  """Every ``--compare`` variant (or the one ``--method``), parsed and built now, so a bad
  one fails before any training. The recipe's method options fill what the spec and the
  flags leave out, except under an outer loop, where no recipe applies."""
  texts = [args.method] if args.method else [t for t in args.compare.split(",") if t]
  recipe = {} if args.outer_every else RECIPE_OPTIONS[args.recipe][args.optimizer]
  try:
    return parse_variants(texts, recipe=recipe, density=args.density, teams=args.teams,
                          sag=args.sag, residuals=args.residuals)
  except (ValueError, TypeError) as error:
    raise UsageError(str(error)) from None


def _check_writable(out: str) -> None:
  """Creates ``out`` and writes a file there, so a run never trains to the end only to
  find it cannot write its results."""
  try:
    os.makedirs(out, exist_ok=True)
    probe = os.path.join(out, f".write-test-{os.getpid()}")
    with open(probe, "w") as f:
      f.write("")
    os.remove(probe)
  except OSError as error:
    raise UsageError(f"--out {out!r} cannot be written: {error.strerror or error}.") from None


def run(args) -> int:
  if args.describe:
    print(describe(args.model, args.model_size))
    return 0
  for flag in ("momentum", "outer_momentum"):
    if getattr(args, flag) >= 1:
      raise UsageError(f"--{flag.replace('_', '-')} must be in [0, 1), got "
                       f"{getattr(args, flag)}.")
  if args.checkpoint_every and not args.checkpoint:
    raise UsageError("--checkpoint-every saves inside an epoch, which needs --checkpoint.")
  variants = _variants(args)
  logging.basicConfig(format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
  log.setLevel(logging.INFO)
  from spardl_jax import distributed
  from train.mesh import simulate_devices

  # A multi-process job (python -m spardl_jax.launch, or --distributed on a cluster) sets
  # its local devices itself; --devices then counts the devices of all processes.
  if not distributed.initialize(auto=args.distributed):
    simulate_devices(args.devices or (math.prod(n for _, n in args.mesh) if args.mesh
                                      else SIMULATED_DEVICES))
  if jax.process_index() != 0:
    log.setLevel(logging.WARNING)  # one logging process
  from train.mesh import make_mesh
  from train.train import check_model_data

  # Every field of TrainConfig is a flag of the same name (the variants are built above).
  cfg = TrainConfig(variants=variants, **{
      f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
      if f.name in vars(args)})
  check_model_data(cfg.model, cfg.dataset)
  mesh = make_mesh(cfg.devices, cfg.axis_name, axes=cfg.mesh, islands=cfg.islands)
  if cfg.batch_size % mesh.size:
    raise UsageError(f"--batch-size ({cfg.batch_size}) must be a multiple of the "
                     f"{mesh.size} devices.")
  _check_writable(cfg.out)
  return _train_variants(args, cfg, variants, mesh)


def _train_variants(args, cfg: TrainConfig, variants, mesh) -> int:
  """Loads the data and checks every variant, then trains them under the run folder's lock."""
  from train import data, lock
  from train.train import check_variant, data_request

  ds = data.load(cfg.dataset, data_request(cfg))
  log.info("%s: %d train / %d test examples; %s on %d %s devices; methods: %s", ds.name,
           len(ds.train), len(ds.test), cfg.model, mesh.size,
           mesh.devices.flat[0].platform, ", ".join(v.label for v in variants))
  if cfg.outer_every:
    log.info("outer loop: each device trains alone for %d steps, then the method syncs the "
             "parameter change for a Nesterov step (lr %g, momentum %g); no recipe applies",
             cfg.outer_every, cfg.outer_lr, cfg.outer_momentum)
  elif any(sj.methods.is_sparse(v.method) for v in variants):
    recipe = {**RECIPES[cfg.recipe][cfg.optimizer], **{
        f"{method}:{key}": value
        for method, options in RECIPE_OPTIONS[cfg.recipe][cfg.optimizer].items()
        for key, value in options.items()}}
    log.info("sparse methods use the %r recipe (%s) unless their spec or a flag says "
             "otherwise%s", cfg.recipe,
             ", ".join(f"{k}={v}" for k, v in recipe.items()) or "no tuning",
             "; --recipe paper for plain SparDL" if recipe else "")
  ckpts = {v.label: (os.path.join(cfg.out, "checkpoints", v.label.replace(":", "_"))
                    if args.checkpoint else None) for v in variants}
  for variant in variants:  # every variant is checked before the first one trains
    try:
      check_variant(cfg, variant, ds, mesh, checkpoint_dir=ckpts[variant.label])
    except (ValueError, TypeError) as error:
      flag = "--method" if args.method else "--compare"
      raise UsageError(f"{flag} {variant.label!r}: {error}") from None
  # One writer per run folder (process 0 writes for a multi-process job), taken once every
  # flag is known good so that a refused command leaves nothing behind.
  with lock.writer(cfg.out) if jax.process_index() == 0 else contextlib.nullcontext():
    return _train_each(args, cfg, variants, ds, mesh, ckpts)


def _train_each(args, cfg: TrainConfig, variants, ds, mesh, ckpts) -> int:
  """Trains each variant in turn, writing the results after each."""
  from train import report
  from train.train import train_and_evaluate

  results = []
  for variant in variants:
    result = train_and_evaluate(cfg, variant, ds, mesh, progress=not args.no_progress,
                                checkpoint_dir=ckpts[variant.label])
    last = result.history[-1]
    log.info("%s: test %s %.4f after %d epochs (%d params, %.1f ms/step)", variant.label,
             result.metric, last[f"test_{result.metric}"], cfg.epochs, result.num_params,
             result.time_per_step * 1e3)
    results.append(result)
    if jax.process_index() == 0:  # after each variant: a later failure keeps these
      paths = report.write(cfg.out, results, dataclasses.asdict(cfg))
  if jax.process_index() == 0:
    print(report.format_table(report.runs_of(results)))
    log.info("wrote %s", ", ".join(paths))
  return 0
