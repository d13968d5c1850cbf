"""Benchmark: one SparDL all-reduce against a dense ``pmean`` on simulated CPU devices.

Usage::

  python -m spardl_jax.bench                       # 8 devices, n = 1e6 and 14.7e6, 1 %
  python -m spardl_jax.bench --n 14.7e6 --repeats 9 --out bench_out --trace bench_out/trace

For each size it reports the median wall time of one call (each call waited for, which also
guards against the CPU rendezvous deadlock of many simulated devices on few cores), the
bytes each device sends and the rounds, both measured from the compiled HLO, next to the
DESIGN.md formula. ``--trace`` writes a Perfetto trace of a few SparDL calls (open it in
ui.perfetto.dev) to see where the time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def _parse_sizes(text: str) -> list[int]:
  try:
    sizes = [int(float(v)) for v in text.split(",") if v.strip()]
  except ValueError:
    sizes = []
  if not sizes or min(sizes) < 1:
    raise argparse.ArgumentTypeError(f"--n must be a comma list of positive numbers, got {text!r}")
  return sizes


def _parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m spardl_jax.bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--devices", type=int, default=8,
                      help="simulated CPU devices (on GPU: how many real devices to use)")
  parser.add_argument("--n", type=_parse_sizes, default=[1_000_000, 14_700_000],
                      help="gradient sizes, comma separated (default 1e6,14.7e6)")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--repeats", type=int, default=5, help="timed calls per method")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", help="directory for results.json")
  parser.add_argument("--trace", help="directory for a Perfetto trace of SparDL calls")
  args = parser.parse_args(argv)
  if args.devices < 1 or args.repeats < 1:
    parser.error("--devices and --repeats must be >= 1")
  return args


def _median_seconds(fn, args, repeats) -> float:
  import jax
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def run(args) -> list[dict]:
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  from tqdm import tqdm

  import spardl_jax as sj
  from spardl_jax import traffic

  if len(jax.devices()) < args.devices:
    raise SystemExit(f"--devices {args.devices}: only {len(jax.devices())} devices available")
  axis = "data"
  mesh = jax.make_mesh((args.devices,), (axis,), devices=jax.devices()[:args.devices],
                       axis_types=(jax.sharding.AxisType.Explicit,))
  sharded = NamedSharding(mesh, P(axis))
  spardl = sj.sharded_allreduce(sj.SparDLConfig(density=args.density), mesh, axis)
  dense = jax.jit(jax.shard_map(lambda x: jax.lax.pmean(x, axis), mesh=mesh,
                                in_specs=P(axis), out_specs=P(axis)))
  rows = []
  for n in tqdm(args.n, desc="sizes", unit="size", file=sys.stderr):
    x = jax.device_put(jax.random.normal(jax.random.key(args.seed), (args.devices, n)), sharded)
    r = jax.device_put(jnp.zeros((args.devices, n)), sharded)
    # One compilation serves both the HLO traffic count and the timing.
    compiled = spardl.lower(x, r).compile()
    measured = traffic.parse_hlo(compiled.as_text())
    kb = sj.BlockLayout.make(n, args.devices, args.density).kb
    formula = traffic.spardl_formula(args.devices, kb)
    t_dense = _median_seconds(dense, (x,), args.repeats)
    t_spardl = _median_seconds(compiled, (x, r), args.repeats)
    rows.append({
        "n": n, "devices": args.devices, "density": args.density, "kb": kb,
        "dense_s": t_dense, "spardl_s": t_spardl, "ratio": t_spardl / t_dense,
        "hlo_bytes_per_device": measured.bytes_sent(0), "formula_bytes": formula["bytes"],
        "hlo_rounds": measured.rounds, "formula_rounds": formula["rounds"],
        # What a bandwidth-optimal (ring) float32 all-reduce sends per device, for scale.
        "dense_ring_bytes_per_device": 2 * 4 * n * (args.devices - 1) // args.devices,
        "other_collectives": [c.op for c in measured.others],
    })
    if args.trace:
      with jax.profiler.trace(os.path.join(args.trace, f"n{n}"), create_perfetto_trace=True):
        for _ in range(3):
          jax.block_until_ready(compiled(x, r))
  return rows


def format_table(rows: list[dict]) -> str:
  head = ("| n | P | kb | dense pmean (s) | SparDL (s) | SparDL / dense | HLO bytes/device "
          "| formula bytes | HLO rounds | formula rounds |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    lines.append(
        f"| {r['n']:,} | {r['devices']} | {r['kb']:,} | {r['dense_s']:.3f} | "
        f"{r['spardl_s']:.3f} | {r['ratio']:.2f}x | {r['hlo_bytes_per_device']:,} | "
        f"{r['formula_bytes']:,} | {r['hlo_rounds']} | {r['formula_rounds']} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  args = _parse_args(sys.argv[1:] if argv is None else argv)
  import jax
  # Before JAX starts its CPU backend; ignored on GPU hosts, which use their real devices.
  jax.config.update("jax_num_cpu_devices", args.devices)
  rows = run(args)
  machine = (f"{platform.machine()}, {os.cpu_count()} cores, {jax.devices()[0].platform}, "
             f"jax {jax.__version__}")
  print(f"SparDL vs dense pmean, density {args.density}, median of {args.repeats} ({machine})")
  print(format_table(rows))
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump({"machine": machine, "rows": rows}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
