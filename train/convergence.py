"""Convergence on the offline datasets: SparDL at 1 % against dense, same epochs and seeds.

Usage::

  python -m train.convergence --out docs/convergence          # every case, seeds 0,1
  python -m train.convergence --cases shakespeare_lstm --seeds 0

Each case trains one model on one offline dataset with both gradient syncs on 8 simulated
devices, for each seed, and records the final test metric, the test loss and the bytes per
step. ``--out`` gets ``results.json``, ``results.md`` (the table) and ``convergence.png``
(test metric per epoch, one panel per case, mean over seeds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

from train.config import TrainConfig, Variant

VARIANTS = (Variant("dense", "dense", {}), Variant("spardl 1%", "spardl", {"density": 0.01}))
CASES: dict[str, TrainConfig] = {
    "mnist1d_cnn1d": TrainConfig(model="cnn1d", dataset="mnist1d", epochs=30),
    "digits_resnet20": TrainConfig(model="resnet20", dataset="digits", epochs=15, batch_size=64,
                                   lr=0.05),
    "shakespeare_lstm": TrainConfig(model="lstm_ptb", model_size="tiny", dataset="shakespeare",
                                    epochs=10, batch_size=64, seq_len=64, steps_per_epoch=200,
                                    eval_steps=30, lr=0.5, momentum=0.9),
    "shakespeare_bert": TrainConfig(model="bert", model_size="tiny", dataset="shakespeare",
                                    epochs=10, batch_size=64, seq_len=64, steps_per_epoch=200,
                                    eval_steps=30, optimizer="adamw", lr=1e-3),
}


def _parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m train.convergence", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cases", default="all", help=f"comma list of {', '.join(CASES)} or all")
  p.add_argument("--seeds", default="0,1", help="comma list of seeds")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--out", default="convergence_out")
  args = p.parse_args(argv)
  args.cases = list(CASES) if args.cases == "all" else args.cases.split(",")
  for c in args.cases:
    if c not in CASES:
      p.error(f"--cases: unknown {c!r}; choose from {', '.join(CASES)}")
  args.seeds = [int(s) for s in args.seeds.split(",")]
  return args


def format_table(rows: list[dict]) -> str:
  """One line per case and method: metric and loss (mean and per seed), bytes per step."""
  lines = ["| case | model (params) | method | test metric, mean (per seed) | test loss | "
           "bytes/step |", "|---|---|---|---|---:|---:|"]
  for r in rows:
    per_seed = ", ".join(f"{v:.3f}" for v in r["metric"])
    lines.append(f"| {r['case']} | {r['model']} ({r['params']:,}) | {r['method']} | "
                 f"{r['metric_name']} {np.mean(r['metric']):.3f} ({per_seed}) | "
                 f"{np.mean(r['loss']):.3f} | {r['bytes_per_step']:,.0f} |")
  return "\n".join(lines)


def plot(path: str, curves: dict) -> None:
  """``curves[case][method] = (metric name, (seeds, epochs) array)`` -> one panel per case."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.6), squeeze=False)
  for ax, (case, methods) in zip(axes[0], curves.items()):
    metric = next(iter(methods.values()))[0]
    for method, (_, values) in methods.items():
      epochs = np.arange(1, values.shape[1] + 1)
      ax.plot(epochs, values.mean(0), marker=".", label=method)
      ax.fill_between(epochs, values.min(0), values.max(0), alpha=0.2)
    ax.set(title=case, xlabel="epoch", ylabel=f"test {metric}")
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> int:
  args = _parse_args(argv)
  from tqdm import tqdm

  from train import data
  from train.train import data_request, make_mesh, simulate_devices, train_and_evaluate

  simulate_devices(args.devices)

  mesh = make_mesh(args.devices)
  rows, curves = [], {}
  jobs = [(c, s, v) for c in args.cases for s in args.seeds for v in VARIANTS]
  results: dict = {}
  for case, seed, variant in tqdm(jobs, desc="runs", unit="run", file=sys.stderr):
    cfg = dataclasses.replace(CASES[case], devices=args.devices, seed=seed)
    ds = data.load(cfg.dataset, data_request(cfg))
    r = train_and_evaluate(cfg, variant, ds, mesh, progress=False)
    results.setdefault((case, variant.label), []).append(r)
  for (case, label), runs in results.items():
    metric = runs[0].metric
    rows.append({"case": case, "model": CASES[case].model, "params": runs[0].num_params,
                 "method": label, "metric_name": metric,
                 "metric": [r.history[-1][f"test_{metric}"] for r in runs],
                 "loss": [r.history[-1]["test_loss"] for r in runs],
                 "bytes_per_step": runs[0].bytes_per_step,
                 "time_per_step": float(np.median([r.time_per_step for r in runs])),
                 "history": [r.history for r in runs]})
    curves.setdefault(case, {})[label] = (metric, np.array(
        [[h[f"test_{metric}"] for h in r.history] for r in runs]))
  table = format_table(rows)
  print(table)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"devices": args.devices, "seeds": args.seeds, "rows": rows}, f, indent=2)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(table + "\n")
  plot(os.path.join(args.out, "convergence.png"), curves)
  return 0


if __name__ == "__main__":
  sys.exit(main())
