"""Benchmark: SparDL all-reduces against a dense ``pmean`` on simulated CPU devices.

Usage::

  python -m spardl_jax.bench                       # 8 devices, n = 1e6 and 14.7e6, 1 %
  python -m spardl_jax.bench --n 14.7e6 --repeats 9 --out bench_out --trace bench_out/trace
  python -m spardl_jax.bench --devices 12,14 --n 14.7e6 --teams all   # every team count d

For each device count, size and team count it reports the median wall time of one call
(each call waited for, which also guards against the CPU rendezvous deadlock of many
simulated devices on few cores), the bytes each device sends and the rounds, both measured
from the compiled HLO, next to the DESIGN.md formula, and the alpha-beta modeled time
``rounds * alpha + bytes * beta`` (``*`` marks the d that ``teams='auto'`` picks). B-SAG is
timed and counted at its first-step ``h = ceil(kb / d)``; the model assumes ``h = kb``.
``--trace`` writes a Perfetto trace of a few SparDL calls (open it in ui.perfetto.dev).
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
  parser.add_argument("--devices", type=_parse_sizes, default=[8],
                      help="simulated CPU devices, comma separated (on GPU: real devices)")
  parser.add_argument("--n", type=_parse_sizes, default=[1_000_000, 14_700_000],
                      help="gradient sizes, comma separated (default 1e6,14.7e6)")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--repeats", type=int, default=5, help="timed calls per method")
  parser.add_argument("--teams", default="1",
                      help="team counts d: a comma list, or 'all' for every divisor of P")
  parser.add_argument("--sag", default="auto", choices=["auto", "recursive", "bruck"])
  parser.add_argument("--alpha", type=float, default=50e-6, help="latency per round (s)")
  parser.add_argument("--beta", type=float, default=1 / 1.25e9, help="seconds per byte")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", help="directory for results.json")
  parser.add_argument("--trace", help="directory for a Perfetto trace of SparDL calls")
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error("--repeats must be >= 1")
  if args.teams != "all":
    try:
      args.teams = [int(v) for v in args.teams.split(",")]
    except ValueError:
      parser.error(f"--teams must be a comma list of ints or 'all', got {args.teams!r}")
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


def _teams(args, p: int) -> list[int]:
  divisors = [d for d in range(1, p + 1) if p % d == 0]
  if args.teams == "all":
    return [d for d in divisors if not (args.sag == "recursive" and d & (d - 1))]
  bad = [d for d in args.teams if d not in divisors]
  if bad:
    raise SystemExit(f"--teams {bad} do not divide --devices {p}; allowed: {divisors}")
  return args.teams


def run(args) -> list[dict]:
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  from tqdm import tqdm

  import spardl_jax as sj
  from spardl_jax import cost, schedule, traffic

  rows = []
  axis = "data"
  for p in args.devices:
    if len(jax.devices()) < p:
      raise SystemExit(f"--devices {p}: only {len(jax.devices())} devices available")
    mesh = jax.make_mesh((p,), (axis,), devices=jax.devices()[:p],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    sharded = NamedSharding(mesh, P(axis))
    dense = jax.jit(jax.shard_map(lambda x: jax.lax.pmean(x, axis), mesh=mesh,
                                  in_specs=P(axis), out_specs=P(axis)))
    for n in args.n:
      x = jax.device_put(jax.random.normal(jax.random.key(args.seed), (p, n)), sharded)
      t_dense = _median_seconds(dense, (x,), args.repeats)
      best = cost.choose_teams(p, n, args.density, alpha=args.alpha, beta=args.beta,
                               sag=args.sag)
      for d in tqdm(_teams(args, p), desc=f"P={p} n={n:,}", unit="d", file=sys.stderr):
        config = sj.SparDLConfig(density=args.density, teams=d, sag=args.sag)
        kind = cost.sag_kind(d, args.sag) if d > 1 else "recursive"
        state = jax.device_put(sj.allreduce.init_rows(p, n, config), sharded)
        # One compilation serves both the HLO traffic count and the timing.
        compiled = sj.sharded_allreduce(config, mesh, axis).lower(x, state).compile()
        measured = traffic.parse_hlo(compiled.as_text()).branch(0)
        kb = sj.BlockLayout.make(n, p // d, args.density).kb
        h = schedule.h_ladder(kb, d)[0] if kind == "bruck" and d > 1 else kb
        formula = traffic.spardl_formula(p, kb, teams=d, sag=kind, h=h)
        model = cost.spardl_cost(p, n, args.density, d, sag=args.sag)
        t_spardl = _median_seconds(compiled, (x, state), args.repeats)
        rows.append({
            "n": n, "devices": p, "teams": d, "sag": kind if d > 1 else "-",
            "density": args.density, "kb": kb, "h": h,
            "dense_s": t_dense, "spardl_s": t_spardl, "ratio": t_spardl / t_dense,
            "hlo_bytes_per_device": measured.bytes_sent(0), "formula_bytes": formula["bytes"],
            "hlo_rounds": measured.rounds, "formula_rounds": formula["rounds"],
            "modeled_s": cost.modeled_seconds(model, alpha=args.alpha, beta=args.beta),
            "model_pick": d == best,
            # What a bandwidth-optimal (ring) float32 all-reduce sends per device, for scale.
            "dense_ring_bytes_per_device": 2 * 4 * n * (p - 1) // p,
            "other_collectives": [c.op for c in measured.others],
        })
        if args.trace:
          with jax.profiler.trace(os.path.join(args.trace, f"p{p}_n{n}_d{d}"),
                                  create_perfetto_trace=True):
            for _ in range(3):
              jax.block_until_ready(compiled(x, state))
  return rows


def format_table(rows: list[dict]) -> str:
  head = ("| n | P | d | SAG | kb | h | dense pmean (s) | SparDL (s) | SparDL / dense "
          "| HLO bytes/device | formula bytes | HLO rounds | formula rounds | modeled (ms) |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in rows:
    lines.append(
        f"| {r['n']:,} | {r['devices']} | {r['teams']} | {r['sag']} | {r['kb']:,} | "
        f"{r['h']:,} | {r['dense_s']:.3f} | {r['spardl_s']:.3f} | {r['ratio']:.2f}x | "
        f"{r['hlo_bytes_per_device']:,} | {r['formula_bytes']:,} | {r['hlo_rounds']} | "
        f"{r['formula_rounds']} | {r['modeled_s'] * 1e3:.3f}{' *' if r['model_pick'] else ''} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  args = _parse_args(sys.argv[1:] if argv is None else argv)
  import jax
  # Before JAX starts its CPU backend; ignored on GPU hosts, which use their real devices.
  jax.config.update("jax_num_cpu_devices", max(args.devices))
  rows = run(args)
  machine = (f"{platform.machine()}, {os.cpu_count()} cores, {jax.devices()[0].platform}, "
             f"jax {jax.__version__}")
  print(f"SparDL vs dense pmean, density {args.density}, median of {args.repeats} ({machine}); "
        f"model alpha={args.alpha:g} s, beta={args.beta:g} s/B; * = the d teams='auto' picks")
  print(format_table(rows))
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump({"machine": machine, "rows": rows}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
