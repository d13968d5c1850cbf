"""Does a collective run while independent compute runs? Measured over the emulated network.

``sudo python -m benchmarks.overlap --processes 4 --rates 100mbit,1gbit --out overlap_out``
(``--local`` runs the processes on 127.0.0.1: no namespaces, no shaping, no root;
``--in-process`` runs one process over its own devices, several GPUs say, with ``--profile
DIR`` writing a ``jax.profiler`` trace of the timed steps: benchmarks/scripts/gpu_overlap.sh.)

One JAX process per network namespace (:func:`benchmarks.netbench.network`), one CPU device
each, gloo over the shaped links. Every rank times, interleaved, the medians of ``--repeats``:

* ``compute``: a chain of ``--layers`` ``tanh(x @ w)`` on a ``(--batch, --width)`` input, the
  stand-in for a forward and backward pass;
* ``sync``: SparDL's all-reduce of an ``(--n,)`` vector (its state fed back, as in training);
* ``serial``: both in one program, the sync's input depending on the compute's output (an
  undelayed train step: compute, then transfer);
* ``independent``: both in one program with no data dependence between them (a delayed
  step: what XLA may run at once);
* ``two programs``: the sync and the compute as two programs dispatched back to back without
  waiting, then both awaited (JAX's asynchronous dispatch).

Where a mode takes about ``max(compute, sync)`` the transfer is hidden; about ``compute +
sync``, the runtime serializes them. Rank 0 writes ``results.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

from benchmarks import netbench

MODES = ("compute", "sync", "serial", "independent", "two programs")


def worker(args) -> int:
  """One rank: every mode, interleaved; rank 0 writes the medians."""
  from spardl_jax import distributed
  distributed.initialize()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import PartitionSpec as P

  from spardl_jax import collectives, methods

  p = jax.device_count()
  mesh = jax.make_mesh((p,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  rng = np.random.default_rng(0)
  method = methods.make("spardl", p=p, density=args.density)
  state = distributed.shard_rows(collectives.init_rows(method, p, args.n), mesh)
  vec = distributed.shard_rows(rng.standard_normal((p, args.n)).astype(np.float32), mesh)
  xs = distributed.shard_rows(
      rng.standard_normal((p, args.batch, args.width)).astype(np.float32), mesh)
  w = jax.device_put(rng.standard_normal((args.width, args.width)).astype(np.float32)
                     / np.sqrt(args.width), jax.NamedSharding(mesh, P()))

  def compute(w, x):
    for _ in range(args.layers):
      x = jnp.tanh(x @ w)
    return x

  def sync(v, s):
    y, s = method.apply(v[0], jax.tree.map(lambda a: a[0], s), axis_name="data")
    return y[None], jax.tree.map(lambda a: a[None], s)

  rows, rep = P("data"), P()

  def program(body, ins, outs):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=ins, out_specs=outs,
                                 check_vma=False))

  def serial(w, x, v, s):
    x = compute(w, x)
    y, s = sync(v + jnp.mean(x), s)  # the transfer waits for the compute
    return x, y, s

  def independent(w, x, v, s):
    return (compute(w, x), *sync(v, s))

  run_compute = program(compute, (rep, rows), rows)
  run_sync = program(sync, (rows, rows), (rows, rows))
  run_serial = program(serial, (rep, rows, rows, rows), (rows, rows, rows))
  run_independent = program(independent, (rep, rows, rows, rows), (rows, rows, rows))
  states = {mode: state for mode in MODES}

  def step(mode):
    s = states[mode]
    if mode == "compute":
      out = run_compute(w, xs)
    elif mode == "sync":
      out = run_sync(vec, s)
      s = out[1]
    elif mode == "two programs":
      y = run_sync(vec, s)  # dispatched, not awaited
      out = (run_compute(w, xs), *y)
      s = y[1]
    else:
      out = (run_serial if mode == "serial" else run_independent)(w, xs, vec, s)
      s = out[2]
    jax.block_until_ready(out)
    states[mode] = s

  for mode in MODES:  # compile and warm up
    step(mode)
  times: dict[str, list[float]] = {mode: [] for mode in MODES}
  with contextlib.ExitStack() as stack:
    if args.profile:
      stack.enter_context(jax.profiler.trace(args.profile))
    for _ in range(args.repeats):
      for mode in MODES:
        with jax.profiler.TraceAnnotation(mode):
          start = time.perf_counter()
          step(mode)
          times[mode].append(time.perf_counter() - start)
  if jax.process_index() == 0:
    with open(args.out, "w") as f:
      json.dump({mode: statistics.median(t) for mode, t in times.items()}, f)
  return 0


def table(results: dict, args) -> str:
  """The medians per rate, with each mode's time against compute + sync and max of them."""
  lines = [f"median seconds of {args.repeats}, P = {args.processes} processes, SparDL at "
           f"density {args.density} on n = {args.n:,}; compute: {args.layers} layers of "
           f"({args.batch}, {args.width}) @ ({args.width}, {args.width})", "",
           "| rate | " + " | ".join(MODES) + " | compute + sync | max | hidden |",
           "|---|" + "---|" * (len(MODES) + 3)]
  for rate, t in results.items():
    total, longest = t["compute"] + t["sync"], max(t["compute"], t["sync"])
    # The share of the shorter part the one-program delayed step hid (1: all of it, 0: none,
    # below 0: slower than the two parts one after the other); "–" where the shorter part is
    # under a tenth of the step, too small to tell from the noise.
    shorter = total - longest
    hidden = f"{(total - t['independent']) / shorter:.0%}" if shorter >= 0.1 * total else "–"
    lines.append(f"| {rate} | " + " | ".join(f"{t[m]:.3f}" for m in MODES)
                 + f" | {total:.3f} | {longest:.3f} | {hidden} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = netbench.job_parser("python -m benchmarks.overlap", __doc__,
                               rates="100mbit,1gbit", n=4_000_000, repeats=7, timeout=900,
                               out="overlap_out")
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--in-process", action="store_true",
                      help="this process over its own devices (GPUs): no network emulated")
  parser.add_argument("--profile", default=None, metavar="DIR",
                      help="with --in-process: a jax.profiler trace of the timed steps in DIR")
  args = parser.parse_args(argv)
  if args.profile and not args.in_process:
    parser.error("--profile needs --in-process (each rank of a job would write its own)")
  if args.worker:
    return worker(args)
  os.makedirs(args.out, exist_ok=True)
  if args.in_process:
    import jax
    args.processes = jax.device_count()
    out = os.path.join(args.out, "times_devices.json")
    worker(argparse.Namespace(**{**vars(args), "out": out}))
    with open(out) as f:
      return _write({f"{args.processes} {jax.devices()[0].platform} devices": json.load(f)},
                    args)
  if not args.local and os.geteuid() != 0:
    parser.error("needs root (network namespaces and tc); --local runs without them")

  def run(rate, namespaces):
    out = os.path.abspath(os.path.join(args.out, f"times_{rate}.json"))
    cmd = [sys.executable, "-m", "benchmarks.overlap", "--worker", "--out", out,
           *(f"--{k}={getattr(args, k)}" for k in ("n", "density", "layers", "batch",
                                                   "width", "repeats"))]
    return netbench.run_job(cmd, out, processes=args.processes, timeout=args.timeout,
                            namespaces=namespaces, rate=rate)

  return _write(netbench.each_rate(args.processes, args.rates.split(","), args.local, run),
                args)


def _write(results: dict, args) -> int:
  text = table(results, args)
  print(text)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"args": vars(args), "seconds": results}, f, indent=2)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
