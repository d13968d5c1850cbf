"""Per-model train-step benchmark: dense all-reduce against SparDL on simulated devices.

Usage::

  python -m benchmarks.step_time                    # every model, tiny and full, 8 devices
  python -m benchmarks.step_time --models vgg16,bert --sizes full --steps 5 --out bench_out

For each model, size and method it builds the real train step (``train.train``: the model,
the gradient sync, SGD with momentum, inside ``shard_map``) on synthetic batches shaped like
the model's input, and reports the parameters, the compile time, the median wall time of a
step (each waited for) and the bytes each device sends per step (``SyncStats``). Simulated
CPU devices share this machine's cores and memory, so the times measure compute (top-k
selection included), not a network; configurations whose replicated state would exceed
``--max-memory-gb`` are skipped and listed as such.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import numpy as np

from benchmarks import runs
from benchmarks.cli import add_progress
from spardl_jax.tools.progress import bar

DENSITY = 0.01  # for every sparse method whose spec does not say otherwise
# float32 copies of the parameters each device holds during a step: params, gradient,
# momentum, update, the residual and the sync's working vectors.
COPIES = 8


def _parse_args(argv):
  from models import MODELS

  p = argparse.ArgumentParser(prog="python -m benchmarks.step_time", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default="all", help=f"comma list of {', '.join(MODELS)} or all")
  p.add_argument("--sizes", default="tiny,full", help="comma list of tiny, full")
  p.add_argument("--methods", default="dense,spardl",
                 help="comma list of method specs, method[:key=value...], any method of "
                      "spardl_jax.methods (default: %(default)s; density 0.01 unless given)")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--batch-per-device", type=int, default=None,
                 help="examples per device (default: 16 tiny, 2 full)")
  p.add_argument("--steps", type=int, default=3, help="timed steps after the compiling one")
  p.add_argument("--max-memory-gb", type=float, default=16.0)
  p.add_argument("--out", default=None, help="directory for results.json and results.md")
  add_progress(p)
  args = p.parse_args(argv)
  args.models = list(MODELS) if args.models == "all" else args.models.split(",")
  for name in args.models:
    if name not in MODELS:
      p.error(f"--models: unknown {name!r}; choose from {', '.join(MODELS)}")
  args.sizes = args.sizes.split(",")
  args.methods = args.methods.split(",")
  from spardl_jax import methods, options
  for text in args.methods:
    try:
      name, options = _spec(text)
      methods.make(name, **options)
    except (ValueError, TypeError) as error:
      p.error(f"--methods {text!r}: {error}")
  return args


def _spec(text: str):
  """The :class:`spardl_jax.options.MethodSpec` ``(method, options)`` of a method spec."""
  from spardl_jax import options
  return options.parse(text, density=DENSITY)


def synthetic_batch(model, spec, rows: int, seed: int = 0):
  """``(x, y, w, task)``: random inputs shaped like ``spec.example`` and matching targets."""
  rng = np.random.default_rng(seed)
  shape, dtype = spec.example
  if spec.objective:  # token ids in, a token per position out
    x = rng.integers(3, model.vocab_size, (rows, *shape)).astype(np.int32)
    return x, x, np.ones(x.shape, np.float32), spec.objective
  if np.dtype(dtype) == np.int32:  # a text classifier
    x = rng.integers(3, model.vocab_size, (rows, *shape)).astype(np.int32)
  else:
    x = rng.standard_normal((rows, *shape)).astype(np.float32)
  if not hasattr(model, "num_classes"):  # a vector regression (dotrelu: its teacher's width)
    y = rng.standard_normal((rows, model.features)).astype(np.float32)
    return x, y, np.ones(y.shape, np.float32), "regress"  # a weight per target, as the data's
  if model.num_classes == 1:
    return x, rng.random(rows).astype(np.float32), np.ones(rows, np.float32), "regress"
  y = rng.integers(0, model.num_classes, rows).astype(np.int32)
  return x, y, np.ones(rows, np.float32), "classify"


def measure(name: str, size: str, method: str, devices: int, per_device: int,
            steps: int) -> dict:
  """One configuration's parameters, compile time, step time and bytes per step."""
  import jax

  import models
  import spardl_jax as sj
  from train import TrainConfig, Variant
  from train import compile_steps, create_train_state, make_mesh, make_optimizer

  spec = models.spec(name)
  model = models.create(name, size)
  x, y, w, task = synthetic_batch(model, spec, devices * per_device)
  cfg = TrainConfig(model=name, model_size=size, devices=devices, batch_size=len(x))
  mesh = make_mesh(devices)
  tx = make_optimizer(cfg, Variant(method, *_spec(method)))
  state, specs = create_train_state(jax.random.key(0), model, tx, x, mesh, cfg.axis_name)
  train, _ = compile_steps(model, tx, mesh, specs, cfg.axis_name, task=task)
  batch = sj.distributed.shard_rows((x, y, w), mesh, cfg.axis_name)
  start = time.perf_counter()
  state, metrics = jax.block_until_ready(train(state, batch))
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = jax.block_until_ready(train(state, batch))
    times.append(time.perf_counter() - start)
  sent = float(np.asarray(sj.sync_stats(state.opt_state).bytes_sent)[0])
  return {"model": name, "size": size, "method": method, "devices": devices,
          "batch": len(x), "params": models.count(state.params), "compile_s": compile_s,
          "step_s": statistics.median(times), "bytes_per_step": sent,
          "loss": float(np.asarray(metrics.loss))}


def format_table(rows: list[dict]) -> str:
  """A Markdown table, one line per model and size, dense and SparDL side by side (steps in
  seconds to 4 significant digits: a GPU's are a few milliseconds)."""
  lines = ["| model | size | params | batch | dense s/step | SparDL s/step | dense bytes/step "
           "| SparDL bytes/step | ratio |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  keyed = {(r["model"], r["size"], r["method"]): r for r in rows}
  for model, size in dict.fromkeys((r["model"], r["size"]) for r in rows):
    d, s = keyed.get((model, size, "dense"), {}), keyed.get((model, size, "spardl"), {})
    first = d or s

    def cell(r, key, fmt):
      return format(r[key], fmt) if key in r else r.get("skipped", "")

    ratio = (f"{d['bytes_per_step'] / s['bytes_per_step']:.0f}x"
             if "bytes_per_step" in d and "bytes_per_step" in s else "")
    lines.append(f"| {model} | {size} | {first['params']:,} | {first.get('batch', '')} | "
                 f"{cell(d, 'step_s', '.4g')} | {cell(s, 'step_s', '.4g')} | "
                 f"{cell(d, 'bytes_per_step', ',.0f')} | {cell(s, 'bytes_per_step', ',.0f')} "
                 f"| {ratio} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  args = _parse_args(argv)
  import jax

  from train import simulate_devices

  simulate_devices(args.devices)
  import models
  from models.registry import abstract_params

  # Every model's batch is made before the first is timed: one it cannot feed fails now, not
  # after the others' minutes of measurements.
  for name in args.models:
    synthetic_batch(models.create(name, args.sizes[0]), models.spec(name), 1)
  meta = {"devices": args.devices, "platform": jax.devices()[0].platform,
          **runs.provenance()}
  rows: list[dict] = []
  jobs = [(n, s, m) for n in args.models for s in args.sizes for m in args.methods]
  for name, size, method in bar(jobs, desc="configurations", unit="cfg",
                                enabled=not args.no_progress):
    params = models.count(abstract_params(models.create(name, size), models.spec(name).example))
    need_gb = args.devices * params * 4 * COPIES / 2**30
    if need_gb > args.max_memory_gb:
      rows.append({"model": name, "size": size, "method": method, "params": params,
                   "skipped": f"needs ~{need_gb:.2g} GB"})
      continue
    per_device = args.batch_per_device or (16 if size == "tiny" else 2)
    rows.append(measure(name, size, method, args.devices, per_device, args.steps))
    if args.out:  # after each configuration: a run stopped later keeps what it measured
      runs.write_rows(args.out, meta, rows, format_table(rows))
    jax.clear_caches()
    gc.collect()
  print(format_table(rows))
  if args.out:
    runs.write_rows(args.out, meta, rows, format_table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
