"""Time to accuracy over an emulated cluster network: every method trains the same case.

Usage::

  sudo python -m train.time_to_accuracy --out docs/network                  # the benchmark
  python -m train.time_to_accuracy --local --processes 2 --methods dense,spardl \\
      --model-size tiny --epochs 2 --steps-per-epoch 2 --out /tmp/tta        # a smoke run

For each rate (``tc`` rates such as ``100mbit``, or ``unshaped``) one job of ``--processes``
JAX processes, one per network namespace (:func:`spardl_jax.netbench.network`: veth links on
a bridge, each namespace's sending shaped with ``tc tbf``), trains the case with every
method in turn: ``python -m train --compare METHODS`` with one CPU device per process, its
collectives carried by gloo over the links. ``--local`` runs the processes on 127.0.0.1
instead (no namespaces, no shaping, no root): the same code path, for CI.

The case is ``mlp_wide`` on scikit-learn's digits (4.35M parameters): a large gradient and
little compute per step, so the network decides, on an offline dataset (docs/network.md says
why). Each method uses the trainer's defaults, so sparse methods train with the recommended
recipe (docs/models.md).

The clock is the trainer's ``train_seconds``: the wall time of the train steps and their input
pipeline, compilation and evaluations left out. Each target is a fraction (``--targets``) of
dense's final test accuracy at the same rate. For each rate and method the report gives the wall time and
the steps to the target, the final accuracy, the bytes each device sent in total, and the time
to the target with a modeled latency added: ``tbf`` shapes bandwidth only (and ``netem`` is
not available here), so each step's rounds (from the method's formula, which the traffic
tests hold to the compiled HLO) are charged ``--alpha`` seconds each. ``--out`` gets
``results.json``, ``results.md`` and ``time_to_accuracy.png`` (test accuracy against wall
time, one panel per rate, one line per method).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

DEFAULT_METHODS = ("dense,dense_bf16,powersgd:rank=4,powersgd:rank=16,spardl,oktopk,gtopk,topka,"
                   "topkdsa")
RATES = "100mbit,1gbit,unshaped"
# The case: --model, --dataset and the trainer flags that make a run.
CASE = {"model": "mlp_wide", "dataset": "digits", "batch_size": 64, "lr": 0.05}


def _parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m train.time_to_accuracy", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--processes", type=int, default=4)
  p.add_argument("--rates", default=RATES,
                 help=f"comma list of tc rates or 'unshaped' (default {RATES})")
  p.add_argument("--methods", default=DEFAULT_METHODS,
                 help="comma list of method specs as for python -m train --compare; dense "
                      "must be one (it sets the target)")
  p.add_argument("--model-size", default="full", choices=["full", "tiny"],
                 help="tiny: the same MLP at 3,466 parameters, for smoke runs")
  p.add_argument("--epochs", type=int, default=12)
  p.add_argument("--steps-per-epoch", type=int, default=None,
                 help="steps between evaluations (default: a whole epoch, 22 steps)")
  p.add_argument("--targets", default="0.95,0.98",
                 help="targets as fractions of dense's final test accuracy at the same rate, "
                      "comma separated (default 0.95,0.98)")
  p.add_argument("--alpha", type=float, default=5e-4,
                 help="modeled latency per round in seconds (default 0.5 ms)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--timeout", type=float, default=3600, help="seconds per rate")
  p.add_argument("--local", action="store_true",
                 help="processes on 127.0.0.1: no namespaces, no shaping, no root")
  p.add_argument("--out", default="tta_out")
  p.add_argument("--report", action="store_true",
                 help="train nothing: rewrite the report from --out's runs")
  args = p.parse_args(argv)
  args.methods = [m for m in args.methods.split(",") if m]
  args.rates = [r for r in args.rates.split(",") if r]
  if "dense" not in args.methods:
    p.error(f"--methods must include 'dense' (it sets the target), got {args.methods}")
  if args.processes < 1 or args.epochs < 1:
    p.error("--processes and --epochs must be >= 1")
  try:
    args.targets = [float(t) for t in args.targets.split(",")]
  except ValueError:
    args.targets = []
  if not args.targets or not all(0 < t <= 1 for t in args.targets):
    p.error(f"--targets must be a comma list of fractions in (0, 1], got {args.targets!r}")
  if args.local and args.rates != ["unshaped"]:
    p.error(f"--local cannot shape the network: use --rates unshaped, got {args.rates}")
  return args


def train_command(args, out: str) -> list[str]:
  """The trainer's command line for one rate's job (every method in turn)."""
  cmd = [sys.executable, "-m", "train", "--model", CASE["model"], "--model-size",
         args.model_size, "--dataset",
         CASE["dataset"], "--batch-size", str(CASE["batch_size"]), "--lr", str(CASE["lr"]),
         "--compare", ",".join(args.methods), "--devices", str(args.processes), "--epochs",
         str(args.epochs), "--seed", str(args.seed), "--no-progress", "--out", out]
  if args.steps_per_epoch:
    cmd += ["--steps-per-epoch", str(args.steps_per_epoch)]
  return cmd


def run_rates(args) -> None:
  """Trains every method at every rate; each rate's metrics land in ``out/<rate>/``."""
  from spardl_jax.parallel import launch
  from spardl_jax.tools import netbench

  def job(rate, **where):
    out = os.path.join(args.out, rate)
    with open(os.path.join(args.out, f"{rate}.log"), "w") as log:
      code = launch.launch(train_command(args, out), processes=args.processes,
                           timeout=args.timeout, out=log, **where)
    if code:
      raise SystemExit(f"the {rate} job failed (exit {code}); see {log.name}")
    print(f"{rate}: done", file=sys.stderr, flush=True)

  if args.local:
    job("unshaped")
    return
  with netbench.network(args.processes) as namespaces:
    for rate in args.rates:
      netbench.shape(namespaces, rate)
      job(rate, host=f"{netbench.SUBNET}.1", prefix=netbench.in_namespace(namespaces))


def rounds_per_step(specs: list[str], p: int, size: str) -> dict[str, int]:
  """Each method's rounds per sync of the case's gradient (the sparse level's formula)."""
  import jax

  from models import MODELS, create
  from models.registry import abstract_params
  from spardl_jax.sync import methods
  from train.config import parse_variant

  shapes = [leaf.shape for leaf in jax.tree.leaves(abstract_params(
      create(CASE["model"], size, num_classes=10), MODELS[CASE["model"]].example))]
  n = sum(math.prod(s) for s in shapes)
  rounds = {}
  for spec in specs:
    variant = parse_variant(spec, density=0.01, teams=1, sag="auto", residuals="global")
    method = methods.make(variant.method, **variant.options)
    if hasattr(method, "for_leaves"):
      method = method.for_leaves(shapes)
    rounds[spec] = int(method.formula(p=p, n=n, itemsize=4)["rounds"])
  return rounds


def summarize(args) -> list[dict]:
  """One row per (target, rate, method) from the runs under ``args.out``."""
  rounds = rounds_per_step(args.methods, args.processes, args.model_size)
  rows = []
  for fraction, rate in ((f, r) for f in args.targets for r in args.rates):
    with open(os.path.join(args.out, rate, "metrics.json")) as f:
      runs = {r["method"]: r for r in json.load(f)["runs"]}
    target = fraction * runs["dense"]["history"][-1]["test_accuracy"]
    for spec in args.methods:
      history = runs[spec]["history"]
      hit = next((h for h in history if h["test_accuracy"] >= target), None)
      reached = None if hit is None else hit["steps"]
      rows.append({
          "fraction": fraction, "rate": rate, "method": spec, "target": target,
          "seconds_to_target": None if hit is None else hit["train_seconds"],
          "steps_to_target": reached,
          "seconds_with_latency": None if hit is None else (
              hit["train_seconds"] + reached * rounds[spec] * args.alpha),
          "final_accuracy": history[-1]["test_accuracy"],
          "bytes_per_device": history[-1]["bytes_sent"],
          "seconds_per_step": history[-1]["train_seconds"] / history[-1]["steps"],
          "rounds_per_step": rounds[spec],
          "curve": [(h["train_seconds"], h["test_accuracy"]) for h in history],
      })
  return rows


def format_table(rows: list[dict], args) -> str:
  lines = [f"{args.processes} processes; latency modeled at {args.alpha * 1e3:g} ms per round; "
           f"targets are fractions of dense's final test accuracy at the same rate.", "",
           "| target | rate | method | seconds to target | × fastest | steps to target | + "
           "modeled latency (s) | final accuracy | MB sent per device | s/step | rounds/step |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for fraction, rate in dict.fromkeys((r["fraction"], r["rate"]) for r in rows):
    group = [r for r in rows if (r["fraction"], r["rate"]) == (fraction, rate)]
    best = min((r["seconds_to_target"] for r in group if r["seconds_to_target"]),
               default=None)
    for r in sorted(group, key=lambda r: (r["seconds_to_target"] is None,
                                          r["seconds_to_target"] or 0)):
      t, latency = r["seconds_to_target"], r["seconds_with_latency"]
      lines.append(
          f"| {fraction:.0%} ({r['target']:.3f}) | {rate} | {r['method']} | "
          f"{'not reached' if t is None else f'{t:.1f}'} | "
          f"{'-' if t is None else f'{t / best:.2f}'} | {r['steps_to_target'] or '-'} | "
          f"{'-' if t is None else f'{latency:.1f}'} | "
          f"{r['final_accuracy']:.3f} | {r['bytes_per_device'] / 1e6:,.1f} | "
          f"{r['seconds_per_step']:.3f} | {r['rounds_per_step']} |")
  return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
  """Test accuracy against wall time, one panel per rate, one line per method."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rates = list(dict.fromkeys(r["rate"] for r in rows))
  fig, axes = plt.subplots(1, len(rates), figsize=(5.5 * len(rates), 4.2), squeeze=False)
  for ax, rate in zip(axes[0], rates):
    here = [r for r in rows if r["rate"] == rate]
    for r in here:
      if r["fraction"] == here[0]["fraction"]:  # each method's curve once
        ax.plot(*zip(*r["curve"]), marker=".", label=r["method"])
    targets = sorted({r["target"] for r in here})
    for target in targets:
      ax.axhline(target, color="gray", ls=":", lw=1)
    ax.set(title=rate, xlabel="training wall time (s, log)", ylabel="test accuracy",
           xscale="log", ylim=(max(0.0, targets[0] - 0.25), 1.0))
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  args = _parse_args(sys.argv[1:] if argv is None else argv)
  if not args.local and not args.report and os.geteuid() != 0:
    print("python -m train.time_to_accuracy needs root (network namespaces and tc); "
          "--local runs without them.", file=sys.stderr)
    return 2
  os.makedirs(args.out, exist_ok=True)
  args.out = os.path.abspath(args.out)
  if not args.report:
    run_rates(args)
  rows = summarize(args)
  table = format_table(rows, args)
  print(table)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": rows}, f, indent=2)
  plot(rows, os.path.join(args.out, "time_to_accuracy.png"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
