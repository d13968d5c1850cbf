"""Time to accuracy over an emulated cluster network: every method trains the same case.

Usage::

  sudo python -m benchmarks.time_to_accuracy --seeds 0,1,2 --out tta_out       # the benchmark
  python -m benchmarks.time_to_accuracy --report --seeds 0,1,2 --out tta_out   # its report again
  python -m benchmarks.time_to_accuracy --local --processes 2 --methods dense,spardl \\
      --model-size tiny --epochs 2 --steps-per-epoch 2 --out /tmp/tta        # a smoke run

For each rate (``tc`` rates such as ``100mbit``, or ``unshaped``) one job of ``--processes``
JAX processes, one per network namespace (:func:`benchmarks.netbench.network`: veth links on
a bridge, each namespace's sending shaped with ``tc tbf``), trains the case with every
method in turn: ``python -m train --compare METHODS`` with one CPU device per process, its
collectives carried by gloo over the links. ``--local`` runs the processes on 127.0.0.1
instead (no namespaces, no shaping, no root): the same code path, for CI.

The case is ``mlp_wide`` on scikit-learn's digits (4.35M parameters): a large gradient and
little compute per step, so the network decides, on an offline dataset
(benchmarks/results/network.md says why). Each method uses the trainer's defaults, so sparse
methods train with the recommended recipe (docs/trainer.md).

The clock is the trainer's ``train_seconds``: the wall time of the train steps and their input
pipeline, compilation and evaluations left out. Each target is a fraction (``--targets``) of
dense's final test accuracy at the same rate. For each rate and method the report gives the
wall time and the steps to the target, the final accuracy, the bytes each device sent in
total, and the time to the target with a modeled latency added: ``tbf`` shapes bandwidth only
(and ``netem`` is not available here), so each step's rounds (from the method's formula, which
the traffic tests hold to the compiled HLO) are charged ``--alpha`` seconds each. Every seed of
``--seeds`` trains every rate (``--out``/``seed<S>/<rate>/``); the report gives each seed's
table and, over the seeds, the median time to each target and how often each method got there
first. ``--out`` gets ``results.json``, ``results.md`` and ``time_to_accuracy.png`` (test
accuracy against wall time, one panel per rate, one colour per method, one line per seed).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import statistics
import sys
from typing import TypeVar

from benchmarks import runs
from benchmarks.cli import FRACTIONS, SEEDS, add_progress
from spardl_jax.tools.progress import bar
from models.registry import SIZES
from train import (NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT,
                          parse_variants)

DEFAULT_METHODS = ("dense,dense_bf16,powersgd:rank=4,powersgd:rank=16,spardl,oktopk,gtopk,topka,"
                   "topkdsa")
RATES = "100mbit,1gbit,unshaped"
# The case: --model, --dataset and the trainer flags that make a run.
CASE = {"model": "mlp_wide", "dataset": "digits", "batch_size": 64, "lr": 0.05}


def _parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m benchmarks.time_to_accuracy", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--processes", type=POSITIVE_INT, default=4)
  p.add_argument("--rates", default=RATES,
                 help=f"comma list of tc rates or 'unshaped' (default {RATES})")
  p.add_argument("--methods", default=DEFAULT_METHODS,
                 help="comma list of method specs as for python -m train --compare; dense "
                      "must be one (it sets the target)")
  p.add_argument("--model-size", default="full", choices=SIZES,
                 help="tiny: the same MLP at 3,466 parameters, for smoke runs")
  p.add_argument("--epochs", type=POSITIVE_INT, default=20)
  p.add_argument("--steps-per-epoch", type=NON_NEGATIVE_INT, default=11,
                 help="steps between evaluations (default 11, half an epoch of digits; 0: "
                      "a whole epoch)")
  p.add_argument("--targets", type=FRACTIONS, default=[0.95, 0.98],
                 help="targets as fractions of dense's final test accuracy at the same rate, "
                      "comma separated (default 0.95,0.98)")
  p.add_argument("--alpha", type=NON_NEGATIVE_FLOAT, default=5e-4,
                 help="modeled latency per round in seconds (default 0.5 ms)")
  p.add_argument("--seeds", type=SEEDS, default=[0], help="comma list of seeds (default 0)")
  p.add_argument("--timeout", type=POSITIVE_FLOAT, default=3600, help="seconds per rate")
  p.add_argument("--local", action="store_true",
                 help="processes on 127.0.0.1: no namespaces, no shaping, no root")
  p.add_argument("--out", default="tta_out")
  add_progress(p)
  p.add_argument("--report", action="store_true",
                 help="train nothing: rewrite the report from --out's runs")
  p.add_argument("--dense-from", default=None, metavar="DIR",
                 help="read dense's runs from an earlier --out DIR (the same seeds, rates and "
                      "case) instead of training dense: its accuracy curve is the same at "
                      "every rate, bit for bit; its clock is that run's")
  args = p.parse_args(argv)
  args.methods = [m for m in args.methods.split(",") if m]
  args.rates = [r for r in args.rates.split(",") if r]
  if args.dense_from is not None:
    if "dense" in args.methods:
      p.error("--dense-from reads dense's runs: leave 'dense' out of --methods")
    if not os.path.isdir(args.dense_from):
      p.error(f"--dense-from {args.dense_from!r} is not a directory")
    args.methods = ["dense", *args.methods]
  if "dense" not in args.methods:
    p.error(f"--methods must include 'dense' (it sets the target), got {args.methods}")
  try:  # here, not in each rank's log after the processes started
    parse_variants(args.methods)
  except ValueError as error:
    p.error(str(error).replace("--compare", "--methods", 1))
  if args.local and args.rates != ["unshaped"]:
    p.error(f"--local cannot shape the network: use --rates unshaped, got {args.rates}")
  if os.path.exists(args.out) and not os.path.isdir(args.out):
    p.error(f"--out {args.out!r} is a file, not a directory")
  return args


SHAPER_FILE = "shaper.json"  # the shaper's token bucket of the runs under --out


def train_command(args, out: str, seed: int) -> list[str]:
  """The trainer's command line for one rate's job (every method in turn)."""
  trained = args.methods[1:] if args.dense_from else args.methods
  cmd = [sys.executable, "-m", "train", "--model", CASE["model"], "--model-size",
         args.model_size, "--dataset",
         CASE["dataset"], "--batch-size", str(CASE["batch_size"]), "--lr", str(CASE["lr"]),
         "--compare", ",".join(trained), "--devices", str(args.processes), "--epochs",
         str(args.epochs), "--seed", str(seed), "--no-progress", "--out", out]
  if args.steps_per_epoch:
    cmd += ["--steps-per-epoch", str(args.steps_per_epoch)]
  return cmd


def run_dir(args, seed: int, rate: str) -> str:
  """Where one seed's job at one rate writes its metrics."""
  return os.path.join(args.out, f"seed{seed}", rate)


def run_rates(args) -> None:
  """Trains every method at every rate, for every seed."""
  from spardl_jax import launch
  from benchmarks import netbench

  def job(seed, rate, **where):
    out = run_dir(args, seed, rate)
    os.makedirs(out, exist_ok=True)
    with open(f"{out}.log", "w") as log:
      code = launch.launch(train_command(args, out, seed), processes=args.processes,
                           timeout=args.timeout, out=log, **where)
    if code:
      raise SystemExit(f"the {rate} job of seed {seed} failed (exit {code}); see {log.name}")
    print(f"seed {seed}, {rate}: done", file=sys.stderr, flush=True)

  shown = not args.no_progress
  if args.local:
    for seed in bar(args.seeds, desc="jobs", unit="job", enabled=shown):
      job(seed, "unshaped")
    return
  record_shaper(args.out, args.rates)
  with netbench.network(args.processes) as namespaces:
    jobs = [(seed, rate) for seed in args.seeds for rate in args.rates]
    for seed, rate in bar(jobs, desc="jobs", unit="job", enabled=shown):
      netbench.shape(namespaces, rate)
      job(seed, rate, **netbench.launch_where(namespaces))


def record_shaper(out: str, rates: list[str]) -> None:
  """Writes what --report reads back of the shaper: each rate's bucket, keeping those of
  earlier runs into the same ``out`` (another seed at other rates, say)."""
  from benchmarks import netbench

  shaper = os.path.join(out, SHAPER_FILE)
  record = netbench.shaper_record(rates)
  if os.path.exists(shaper):
    with open(shaper) as f:
      record["tbf_burst_bytes"] = {**json.load(f)["tbf_burst_bytes"],
                                   **record["tbf_burst_bytes"]}
  with open(shaper, "w") as f:
    json.dump(record, f)


def rounds_per_step(specs: list[str], p: int, size: str) -> dict[str, float]:
  """Each method's rounds per step of the case's gradient (the sparse level's formula; an
  outer loop's ``outer=H`` syncs once every ``H`` steps)."""
  import jax

  from models import MODELS, create
  from models.registry import abstract_params
  from train import parse_variant

  shapes = [leaf.shape for leaf in jax.tree.leaves(abstract_params(
      create(CASE["model"], size, num_classes=10), MODELS[CASE["model"]].example))]
  n = sum(math.prod(s) for s in shapes)
  rounds = {}
  for spec in specs:
    variant = parse_variant(spec)
    method = variant.spec.build(p).for_leaves(shapes)
    rounds[spec] = int(method.formula(p=p, n=n, itemsize=4).rounds) / (
        variant.tuning.outer or 1)
  return rounds


@dataclasses.dataclass
class Timed:
  """One run (a seed, a rate, a method) against one target: what its ``results.json`` keeps
  a row of and each seed's table is formatted from.

  Attributes:
    seed, fraction, rate, method: the run and the target (a fraction of dense's final test
      accuracy at the same seed and rate).
    target: the target's accuracy.
    seconds_to_target, steps_to_target: training seconds and steps to it; None: never.
    seconds_with_latency: with the modeled latency per round added.
    final_accuracy: the run's final test accuracy.
    bytes_per_device: what each device sent over the run.
    seconds_per_step: the run's training seconds over its steps.
    rounds_per_step: the sync's rounds a step (an outer loop's over its H).
    curve: ``(training seconds, test accuracy)`` at each evaluation.
  """
  seed: int
  fraction: float
  rate: str
  method: str
  target: float
  seconds_to_target: float | None
  steps_to_target: int | None
  seconds_with_latency: float | None
  final_accuracy: float
  bytes_per_device: float
  seconds_per_step: float
  rounds_per_step: float
  curve: list = dataclasses.field(default_factory=list)

  @classmethod
  def from_json(cls, row: dict) -> Timed:
    return cls(**row)


@dataclasses.dataclass
class OverSeeds:
  """One method at one rate and target over the seeds (:func:`over_seeds`)."""
  fraction: float
  rate: str
  method: str
  seeds: list[int]
  seconds_to_target: list[float | None]
  median_seconds: float | None
  median_steps: float | None
  first: int
  mean_final_accuracy: float


def summarize(args) -> list[Timed]:
  """One row per (seed, target, rate, method) from the runs under ``args.out``; a (seed,
  rate) without a finished run is left out (a report may cover fewer runs than a seed)."""
  rounds = rounds_per_step(args.methods, args.processes, args.model_size)
  finished = {}
  for seed, rate in ((s, r) for s in args.seeds for r in args.rates):
    path = os.path.join(run_dir(args, seed, rate), "metrics.json")
    found = runs.lookup(path)
    if found is None:
      print(f"no run for seed {seed} at {rate} ({path}): left out", file=sys.stderr)
      continue
    finished[seed, rate] = {run.label: run for run in found}
    if args.dense_from:
      earlier = os.path.join(args.dense_from, f"seed{seed}", rate, "metrics.json")
      dense = runs.lookup(earlier)
      if dense is None:
        raise ValueError(f"--dense-from has no run for seed {seed} at {rate} ({earlier}).")
      finished[seed, rate]["dense"] = {run.label: run for run in dense}["dense"]
    devices = {run.devices for run in finished[seed, rate].values()}
    if devices != {args.processes}:  # rounds per step depend on it
      raise ValueError(f"{path} was trained on {', '.join(map(str, devices))} processes: pass "
                       f"--processes {', '.join(map(str, devices))}, got {args.processes}.")
    missing = [spec for spec in args.methods if spec not in finished[seed, rate]]
    if missing:
      raise ValueError(f"{path} has no run of {missing}: it holds "
                       f"{list(finished[seed, rate])}; pass those in --methods.")
  rows = []
  for seed, fraction, rate in ((s, f, r) for s in args.seeds for f in args.targets
                               for r in args.rates if (s, r) in finished):
    here = finished[seed, rate]
    goal = runs.target([here["dense"].final], fraction)
    for spec in args.methods:
      history = here[spec].history
      hit = runs.first_reaching(history, goal, metric=lambda h: h["test_accuracy"])
      reached = None if hit is None else hit["steps"]
      rows.append(Timed(
          seed, fraction, rate, spec, goal,
          seconds_to_target=None if hit is None else hit["train_seconds"],
          steps_to_target=reached,
          seconds_with_latency=None if hit is None else (
              hit["train_seconds"] + reached * rounds[spec] * args.alpha),
          final_accuracy=history[-1]["test_accuracy"],
          bytes_per_device=history[-1]["bytes_sent"],
          seconds_per_step=history[-1]["train_seconds"] / history[-1]["steps"],
          rounds_per_step=rounds[spec], curve=here[spec].curve("train_seconds")))
  return rows


def over_seeds(rows: list[Timed]) -> list[OverSeeds]:
  """Per (target, rate, method): each seed's seconds to the target, their median (a seed
  that never got there counts as infinitely slow), and in how many seeds it was first."""
  firsts: collections.Counter = collections.Counter()
  for key in dict.fromkeys((r.fraction, r.rate, r.seed) for r in rows):
    ranked, best = _ranked([r for r in rows if (r.fraction, r.rate, r.seed) == key],
                           "seconds_to_target")
    if best is not None:
      firsts[key[0], key[1], ranked[0].method] += 1
  summary = []
  for fraction, rate, method in dict.fromkeys((r.fraction, r.rate, r.method) for r in rows):
    group = [r for r in rows if (r.fraction, r.rate, r.method) == (fraction, rate, method)]
    seconds = [r.seconds_to_target for r in group]
    median = statistics.median(math.inf if t is None else t for t in seconds)
    steps = statistics.median(math.inf if r.steps_to_target is None else r.steps_to_target
                              for r in group)
    summary.append(OverSeeds(
        fraction, rate, method, seeds=[r.seed for r in group], seconds_to_target=seconds,
        median_seconds=None if math.isinf(median) else median,
        median_steps=None if math.isinf(steps) else steps, first=firsts[fraction, rate, method],
        mean_final_accuracy=statistics.fmean(r.final_accuracy for r in group)))
  return summary


def _seconds(t) -> str:
  return "not reached" if t is None else f"{t:.1f}"


R = TypeVar("R", Timed, OverSeeds)


def _ranked(group: list[R], field: str) -> tuple[list[R], float | None]:
  """One (target, rate)'s rows fastest first by ``field`` (never reached last), and the
  fastest time (None when no method got there)."""
  time = lambda r: getattr(r, field)  # noqa: E731
  reached = [time(r) for r in group if time(r) is not None]
  return (sorted(group, key=lambda r: math.inf if time(r) is None else time(r)),
          min(reached, default=None))


def side_by_side(rows: list[Timed], summary: list[OverSeeds]) -> list[str]:
  """One line per method over the rates that every seed ran: the median seconds to each
  target (each seed's in brackets), the mean seconds per step and the MB each device sent
  (the mean over those runs)."""
  seeds = list(dict.fromkeys(r.seed for r in rows))
  rates = [rate for rate in dict.fromkeys(r.rate for r in rows)
           if {r.seed for r in rows if r.rate == rate} == set(seeds)]
  fractions = list(dict.fromkeys(r.fraction for r in rows))
  if not rates or len(seeds) < 2:
    return []
  head = ["method"]
  for rate in rates:
    head += [f"{rate}: {f:.0%}" if i == 0 else f"{f:.0%}" for i, f in enumerate(fractions)]
    head.append("s/step")
  head.append("MB/device")
  lines = ["", "Side by side, the rates every seed ran (medians, each seed's in brackets):", "",
           "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
  for method in dict.fromkeys(r.method for r in rows):
    cells, sent = [], []
    for rate in rates:
      for fraction in fractions:
        (o,) = [o for o in summary if (o.fraction, o.rate, o.method) == (fraction, rate, method)]
        cells.append(f"{_seconds(o.median_seconds)} "
                     f"({', '.join(map(_seconds, o.seconds_to_target))})")
      mine = [r for r in rows if (r.rate, r.method, r.fraction) == (rate, method, fractions[0])]
      cells.append(f"{statistics.fmean(r.seconds_per_step for r in mine):.3f}")
      sent += [r.bytes_per_device / 1e6 for r in mine]
    lines.append(f"| {method} | {' | '.join(cells)} | {statistics.fmean(sent):,.1f} |")
  return lines


def format_table(rows: list[Timed], summary: list[OverSeeds], args) -> str:
  """The summary over seeds (:func:`over_seeds` of ``rows``), then each seed's table."""
  lines = [f"{args.processes} processes; latency modeled at {args.alpha * 1e3:g} ms per round; "
           f"targets are fractions of dense's final test accuracy at the same rate and seed.",
           "", f"Over seeds {', '.join(map(str, dict.fromkeys(r.seed for r in rows)))}:",
           "", "| target | rate | method | seconds to target, per seed | median | × fastest "
           "median | first in | median steps | mean final accuracy |",
           "|---|---|---|---|---:|---:|---:|---:|---:|"]
  for fraction, rate in dict.fromkeys((o.fraction, o.rate) for o in summary):
    ranked, best = _ranked([o for o in summary if (o.fraction, o.rate) == (fraction, rate)],
                           "median_seconds")
    for o in ranked:
      t = o.median_seconds
      lines.append(
          f"| {fraction:.0%} | {rate} | {o.method} | "
          f"{', '.join(map(_seconds, o.seconds_to_target))} | {_seconds(t)} | "
          f"{'-' if t is None or best is None else f'{t / best:.2f}'} | {o.first} of "
          f"{len(o.seeds)} | {'-' if o.median_steps is None else format(o.median_steps, 'g')} | "
          f"{o.mean_final_accuracy:.3f} |")
  lines += side_by_side(rows, summary)
  for seed in dict.fromkeys(r.seed for r in rows):
    lines += ["", f"Seed {seed}:", "",
              "| target | rate | method | seconds to target | × fastest | steps to target | + "
              "modeled latency (s) | final accuracy | MB sent per device | s/step | "
              "rounds/step |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    mine = [r for r in rows if r.seed == seed]
    for fraction, rate in dict.fromkeys((r.fraction, r.rate) for r in mine):
      ranked_runs, fastest = _ranked(
          [r for r in mine if (r.fraction, r.rate) == (fraction, rate)], "seconds_to_target")
      for r in ranked_runs:
        t, latency = r.seconds_to_target, r.seconds_with_latency
        lines.append(
            f"| {fraction:.0%} ({r.target:.3f}) | {rate} | {r.method} | {_seconds(t)} | "
            f"{'-' if t is None or fastest is None else f'{t / fastest:.2f}'} | "
            f"{r.steps_to_target or '-'} | {'-' if latency is None else f'{latency:.1f}'} | "
            f"{r.final_accuracy:.3f} | {r.bytes_per_device / 1e6:,.1f} | "
            f"{r.seconds_per_step:.3f} | {r.rounds_per_step:g} |")
  return "\n".join(lines)


def plot(rows: list[Timed], path: str) -> None:
  """Test accuracy against wall time, one panel per rate and one colour per method: each
  seed's curve faint, and over several seeds the median curve (median time and accuracy at
  each evaluation) bold; dotted lines at the median targets."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rates = list(dict.fromkeys(r.rate for r in rows))
  methods = list(dict.fromkeys(r.method for r in rows))
  colours = dict(zip(methods, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
  fig, axes = plt.subplots(1, len(rates), figsize=(5.5 * len(rates), 4.2), squeeze=False)
  for ax, rate in zip(axes[0], rates):
    here = [r for r in rows if r.rate == rate]
    once = [r for r in here if r.fraction == here[0].fraction]  # each run once
    for method in methods:
      curves = [r.curve for r in once if r.method == method]
      for curve in curves:
        ax.plot(*zip(*curve), color=colours[method], alpha=0.25 if len(curves) > 1 else 0.9,
                lw=0.8, marker="" if len(curves) > 1 else ".")
      if len(curves) > 1:
        points = min(map(len, curves))
        ax.plot([statistics.median(c[i][0] for c in curves) for i in range(points)],
                [statistics.median(c[i][1] for c in curves) for i in range(points)],
                color=colours[method], lw=2, marker=".")
      ax.plot([], [], color=colours[method], lw=2, label=method)
    for fraction in dict.fromkeys(r.fraction for r in here):
      ax.axhline(statistics.median(r.target for r in here if r.fraction == fraction),
                 color="gray", ls=":", lw=1)
    seeds = len({r.seed for r in once})
    low = min(r.target for r in here)
    ax.set(title=f"{rate} ({seeds} seed{'s' if seeds > 1 else ''})",
           xlabel="training wall time (s, log)", ylabel="test accuracy", xscale="log",
           ylim=(max(0.0, low - 0.25), 1.0))
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  args = _parse_args(sys.argv[1:] if argv is None else argv)
  if not args.local and not args.report and os.geteuid() != 0:
    print("python -m benchmarks.time_to_accuracy needs root (network namespaces and tc); "
          "--local runs without them.", file=sys.stderr)
    return 2
  os.makedirs(args.out, exist_ok=True)
  args.out = os.path.abspath(args.out)
  if not args.report:
    run_rates(args)
  try:
    rows = summarize(args)
  except ValueError as error:  # runs of another job under --out
    print(f"python -m benchmarks.time_to_accuracy: error: {error}", file=sys.stderr)
    return 2
  if not rows:
    print(f"no finished runs under {args.out} for seeds {args.seeds} at {args.rates}",
          file=sys.stderr)
    return 2
  summary = over_seeds(rows)
  table = format_table(rows, summary, args)
  print(table)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(table + "\n")
  shaper = os.path.join(args.out, SHAPER_FILE)
  record = {k: v for k, v in vars(args).items() if k != "report"}
  if os.path.exists(shaper):  # runs shaped before the file was written had a 4 MiB bucket
    with open(shaper) as f:
      record.update(json.load(f))
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"args": record, "rows": [dataclasses.asdict(r) for r in rows],
               "over_seeds": [dataclasses.asdict(o) for o in summary]}, f, indent=2)
  plot(rows, os.path.join(args.out, "time_to_accuracy.png"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
