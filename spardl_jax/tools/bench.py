"""Benchmark: every all-reduce method side by side on simulated CPU devices.

Usage::

  python -m spardl_jax.tools.bench                                 # all methods, paper sizes
  python -m spardl_jax.tools.bench --devices 8,14 --n 14.7e6 --out bench_out
  python -m spardl_jax.tools.bench --devices 12,14 --n 14.7e6 --methods spardl --teams all
  python -m spardl_jax.tools.bench --methods spardl,dense --n 1e6 --trace bench_out/trace
  python -m spardl_jax.tools.bench --selection --n 1e6,14.7e6 --densities 0.01,0.001
  python -m spardl_jax.tools.bench --emulate --devices 8,16 --n 14.7e6,66e6  # one GPU

For each device count ``P``, gradient size ``n`` and method (SparDL once per team count
``d`` and per ``--wire`` format) it reports:

* the rounds and the bytes each device sends, measured from the compiled HLO, next to the
  method's formula (dense ``pmean`` is one all-reduce op: its ring cost is the formula);
* the compute time of one call (median of ``--repeats``, each call waited for, which also
  guards against the CPU rendezvous deadlock of many simulated devices on few cores; the
  state is fed back after a warm-up call, as in training), when the arrays fit in
  ``--max-memory-gb`` (simulated devices share this machine's memory);
* the alpha-beta modeled time ``rounds * alpha + bytes * beta`` for ``--alpha``/``--beta``
  (default 10 Gbit/s Ethernet) and for 100 Gbit/s InfiniBand (``*`` marks the SparDL ``d``
  that ``teams='auto'`` picks);
* the paper's Table 1 (latency and bandwidth cost) evaluated beside the measurement.

B-SAG traffic is read from the branch of the largest message, ``h = kb``, the model's
assumption.

``--selection`` times the selection alone instead, on one device of whatever backend runs
it: SparDL's exact block selection (two stages, with each method of
:mod:`spardl_jax.core.topk`) of the top ``k = ceil(density * n)`` of one ``(n,)`` vector,
against ``lax.top_k`` (exact, sorted) and ``lax.approx_max_k`` (approximate, recall target
0.95), plus one dense elementwise pass over the vector (the memory floor), each the median
of ``--repeats`` after a warm-up; ours is checked to return exactly ``lax.top_k``'s index
set. ``--out`` writes ``results.json`` and ``modeled_time.png`` (modeled time vs
``P`` per method). ``--trace`` writes Perfetto traces of a few calls (ui.perfetto.dev).

``--emulate`` times the whole sync's compute on ONE device with the ``P`` ranks emulated:
``jax.vmap`` with the method's axis name runs all ranks batched, and its collectives become
gathers and permutations inside the device's memory, so no network is timed. Each method
(and ``psum``, as ``dense``) runs the same way; the table gives the time of the batched call
and that time over ``P``: an estimate of one rank's compute, but not what a rank runs (each
selection is a batch of ``P`` rows, and a ``lax.cond`` runs both branches); the repository's
``python -m benchmarks.per_rank`` times one rank's own program. The results are checked:
every rank's output equal to rank 0's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from spardl_jax.core import cost, protocol
from spardl_jax.core.config import ETHERNET_10G, SAG_MODES, WIRE_FORMATS
from spardl_jax.sync import methods as _methods

__all__ = ['flat_methods', 'PAPER_SIZES', 'run', 'run_emulated', 'format_table', 'format_table1',
           'format_emulated', 'plot', 'run_selection', 'format_selection', 'main']

def flat_methods() -> tuple[str, ...]:
  """The registered methods that sync one flat vector. PowerSGD needs the leaf shapes of a
  model (it all-reduces a flat vector dense); the trainer benchmarks it."""
  return tuple(m for m in _methods.names()
               if not protocol.registered()[m].leafwise)

PAPER_SIZES = [14_700_000, 20_100_000, 23_500_000, 9_200_000, 35_200_000, 66_000_000,
               133_500_000]


def _parse_sizes(text: str) -> list[int]:
  if text == "paper":
    return list(PAPER_SIZES)
  try:
    sizes = [int(float(v)) for v in text.split(",") if v.strip()]
  except ValueError:
    sizes = []
  if not sizes or min(sizes) < 1:
    raise argparse.ArgumentTypeError(
        f"must be a comma list of positive numbers (or 'paper' for --n), got {text!r}")
  return sizes


def _parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m spardl_jax.tools.bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--devices", type=_parse_sizes, default=[4, 8, 14],
                      help="device counts P, comma separated (default 4,8,14)")
  parser.add_argument("--n", type=_parse_sizes, default=list(PAPER_SIZES),
                      help="gradient sizes, comma separated, or 'paper' (default: the seven "
                           "models of the paper, 14.7e6 ... 133.5e6)")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--methods", default=",".join(flat_methods()),
                      help=f"comma list from {list(flat_methods())} (default: all)")
  parser.add_argument("--teams", default="1",
                      help="SparDL team counts d: a comma list, or 'all' for every divisor")
  parser.add_argument("--sag", default="auto", choices=SAG_MODES)
  parser.add_argument("--wire", default="exact,compact",
                      help="SparDL message formats, comma separated (default exact,compact)")
  parser.add_argument("--alpha", type=float, default=ETHERNET_10G["alpha"],
                      help="latency per round (s); default 10 Gbit/s Ethernet")
  parser.add_argument("--beta", type=float, default=ETHERNET_10G["beta"],
                      help="seconds per byte; default 10 Gbit/s Ethernet")
  parser.add_argument("--repeats", type=int, default=5, help="timed calls per method")
  parser.add_argument("--max-memory-gb", type=float, default=6.0,
                      help="time a configuration only if its arrays fit in this much memory")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--emulate", action="store_true",
                      help="time each sync on one device with --devices ranks emulated by "
                           "jax.vmap (see above)")
  parser.add_argument("--selection", action="store_true",
                      help="time the top-k selection alone (see above) instead of all-reduces")
  parser.add_argument("--densities", default="0.01,0.001",
                      help="with --selection: densities, comma separated (default 0.01,0.001)")
  parser.add_argument("--out", help="directory for results.json and modeled_time.png")
  parser.add_argument("--trace", help="directory for Perfetto traces")
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error("--repeats must be >= 1")
  if not 0 < args.density <= 1:  # also NaN
    parser.error(f"--density must be in (0, 1], got {args.density}")
  for flag in ("alpha", "beta"):
    if not 0 < getattr(args, flag) < float("inf"):
      parser.error(f"--{flag} must be a positive, finite number, got {getattr(args, flag)}")
  if not 0 <= args.max_memory_gb < float("inf"):  # 0: nothing is timed, only the HLO read
    parser.error(f"--max-memory-gb must be a finite number >= 0, got {args.max_memory_gb}")
  text = args.densities
  try:
    args.densities = [float(d) for d in text.split(",")]
  except ValueError:
    args.densities = []
  if not args.densities or not all(0 < d <= 1 for d in args.densities):
    parser.error(f"--densities must be a comma list of numbers in (0, 1], got {text!r}")
  args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  unknown = sorted(set(args.methods) - set(flat_methods()))
  if unknown:
    parser.error(f"--methods: unknown {unknown}; allowed: {list(flat_methods())}")
  args.wire = [w.strip() for w in args.wire.split(",") if w.strip()]
  if not args.wire or set(args.wire) - set(WIRE_FORMATS):
    parser.error(f"--wire: expected a comma list from {list(WIRE_FORMATS)}, got "
                 f"{','.join(args.wire)!r}")
  if args.teams != "all":
    try:
      args.teams = [int(v) for v in args.teams.split(",")]
    except ValueError:
      parser.error(f"--teams must be a comma list of ints or 'all', got {args.teams!r}")
  return args


def _median_seconds(fn, x, state, repeats: int) -> float:
  """Median wall time of ``fn(x, state)``, the returned state fed back (as training does),
  after one warm-up call."""
  import jax

  _, state = jax.block_until_ready(fn(x, state))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    _, state = jax.block_until_ready(fn(x, state))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _teams(args, p: int) -> list[int]:
  if args.teams == "all":
    return cost.team_counts(p, args.sag)
  bad = [d for d in args.teams if d not in cost.team_counts(p)]
  if bad:
    raise SystemExit(f"--teams {bad} do not divide --devices {p}; allowed: "
                     f"{cost.team_counts(p)}")
  return args.teams


def _variants(args, p: int):
  """``(label, method, teams)`` for every method (SparDL once per team count and wire
  format)."""
  from spardl_jax.core import cost
  from spardl_jax.sync import methods

  for name in args.methods:
    if name == "spardl":
      for d in _teams(args, p):
        for wire in args.wire:
          label = "spardl" + ("" if wire == "exact" else f" {wire}") + (
              "" if d == 1 else f" d={d} ({cost.sag_kind(d, args.sag)[0].upper()}-SAG)")
          yield label, methods.make("spardl", density=args.density, teams=d, sag=args.sag,
                                    wire=wire), d
    else:  # a sparse method at --density; the others with their defaults
      yield name, methods.make(name, **({"density": args.density}
                                        if methods.is_sparse(name) else {})), None


def run(args) -> list[dict]:
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  from tqdm import tqdm

  from spardl_jax.core import cost
  from spardl_jax.sync import methods
  from spardl_jax.tools import traffic

  rows = []
  axis = "data"
  jobs = [(p, n) for p in args.devices for n in args.n]
  for p, n in tqdm(jobs, desc="configurations", unit="cfg", file=sys.stderr):
    if len(jax.devices()) < p:
      raise SystemExit(f"--devices {p}: only {len(jax.devices())} devices available")
    mesh = jax.make_mesh((p,), (axis,), devices=jax.devices()[:p],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    sharded = NamedSharding(mesh, P(axis))
    timed = 8 * p * n * 4 <= args.max_memory_gb * 2**30
    x = None
    if timed:
      x = jax.device_put(jax.random.normal(jax.random.key(args.seed), (p, n)), sharded)
    x_spec = jax.ShapeDtypeStruct((p, n), "float32", sharding=sharded)
    best = cost.choose_teams(p, n, args.density, alpha=args.alpha, beta=args.beta,
                             sag=args.sag)
    for label, method, d in _variants(args, p):
      state_spec = methods.abstract_rows(method, p, n, sharded)
      # One compilation serves both the HLO traffic count and the timing.
      compiled = methods.sharded(method, mesh, axis).lower(x_spec, state_spec).compile()
      measured = traffic.parse_hlo(compiled.as_text()).branch(-1)
      formula = method.formula(p=p, n=n, itemsize=4)
      if not measured.permutes:  # dense: one XLA all-reduce
        # One all-reduce op of S bytes (measured); XLA picks its algorithm, so the rounds and
        # bytes are those of a ring all-reduce of S: 2 (P - 1) rounds, 2 (P - 1) S / P bytes.
        size = sum(c.bytes for c in measured.others if c.op.startswith("all-reduce"))
        hlo_rounds, hlo_bytes = 2 * (p - 1), 2 * (p - 1) * size // p
      else:
        hlo_rounds, hlo_bytes = measured.rounds, max(measured.bytes_sent(i) for i in range(p))
      seconds = None
      if timed:
        state = jax.device_put(methods.init_rows(method, p, n), sharded)
        seconds = _median_seconds(compiled, x, state, args.repeats)
        if args.trace:
          with jax.profiler.trace(os.path.join(args.trace, f"p{p}_n{n}_{label}"),
                                  create_perfetto_trace=True):
            for _ in range(3):
              jax.block_until_ready(compiled(x, state))
      k = max(1, round(args.density * n))
      paper = method.paper_cost(p=p, n=n, k=k)
      rows.append({
          "n": n, "devices": p, "method": label, "teams": d, "density": args.density,
          "hlo_rounds": hlo_rounds, "hlo_bytes_per_device": hlo_bytes,
          "formula_rounds": formula.rounds, "formula_bytes": formula.bytes,
          "time_s": seconds,
          "modeled_s": hlo_rounds * args.alpha + hlo_bytes * args.beta,
          "modeled_ib_s": (hlo_rounds * cost.INFINIBAND_100G["alpha"]
                           + hlo_bytes * cost.INFINIBAND_100G["beta"]),
          "model_pick": d == best,
          "paper_latency_rounds": paper and paper.rounds,
          "paper_bandwidth_elements": paper and paper.elements,
          "hlo_elements": hlo_bytes // 4,
          "other_collectives": [c.op for c in measured.others],
      })
  return rows


def run_emulated(args) -> list[dict]:
  """``--emulate``: each method's sync with ``P`` ranks batched on one device (``jax.vmap``
  with the axis name), timed; rows whose arrays exceed ``--max-memory-gb`` are skipped."""
  import jax
  import numpy as np

  rows = []
  for p in args.devices:
    for n in args.n:
      if 8 * p * n * 4 > args.max_memory_gb * 2**30:
        print(f"P = {p}, n = {n:,}: over --max-memory-gb, skipped", file=sys.stderr)
        continue
      x = jax.random.normal(jax.random.key(args.seed), (p, n))
      for label, method, d in _variants(args, p):
        state = jax.tree.map(lambda a, p=p: jax.numpy.broadcast_to(a, (p, *a.shape)),
                             method.init(n=n, dtype=x.dtype, p=p))
        fn = jax.jit(jax.vmap(lambda x, s, m=method: m.apply(x, s, axis_name="data"),
                              axis_name="data"))
        try:
          y, _ = jax.block_until_ready(fn(x, state))
        except AssertionError as error:  # vmap batches a ppermute only as a full permutation
          rows.append({"n": n, "devices": p, "method": label, "teams": d, "time_s": None,
                       "skipped": f"not emulable with jax.vmap: {error}"})
          continue
        same = bool(np.all(np.asarray(y) == np.asarray(y)[:1]))
        seconds = _median_seconds(fn, x, state, args.repeats)
        rows.append({"n": n, "devices": p, "method": label, "teams": d,
                     "device": jax.devices()[0].device_kind, "time_s": seconds,
                     "per_rank_s": seconds / p, "identical_ranks": same})
  return rows


def format_emulated(rows: list[dict]) -> str:
  """The ``--emulate`` table, with each time against ``dense`` (``psum``) at the same size."""
  lines = ["| n | P | method | batched call (s) | per rank (s) | × psum | ranks identical |",
           "|---|---|---|---|---|---|---|"]
  dense = {(r["n"], r["devices"]): r["time_s"] for r in rows if r["method"] == "dense"}
  for r in rows:
    if r["time_s"] is None:
      lines.append(f"| {r['n']:,} | {r['devices']} | {r['method']} | {r['skipped']} | | | |")
      continue
    base = dense.get((r["n"], r["devices"]))
    ratio = f"{r['time_s'] / base:.1f}" if base else "-"
    lines.append(f"| {r['n']:,} | {r['devices']} | {r['method']} | {r['time_s']:.4f} | "
                 f"{r['per_rank_s']:.5f} | {ratio} | {r['identical_ranks']} |")
  return "\n".join(lines)


def _header(head: str) -> list[str]:
  """A Markdown table's header line and its separator."""
  return [head, "|" + "---|" * (head.count("|") - 1)]


def format_table(rows: list[dict]) -> str:
  head = ("| n | P | method | HLO rounds | formula rounds | HLO bytes/device | formula bytes "
          "| time (s) | modeled 10GbE (ms) | modeled IB (ms) |")
  lines = _header(head)
  for r in rows:
    t = "-" if r["time_s"] is None else f"{r['time_s']:.3f}"
    pick = " *" if r["model_pick"] and r["teams"] else ""
    lines.append(
        f"| {r['n']:,} | {r['devices']} | {r['method']} | {r['hlo_rounds']} | "
        f"{r['formula_rounds']} | {r['hlo_bytes_per_device']:,} | {r['formula_bytes']:,} | "
        f"{t} | {r['modeled_s'] * 1e3:.2f}{pick} | {r['modeled_ib_s'] * 1e3:.3f} |")
  return "\n".join(lines)


def format_table1(rows: list[dict]) -> str:
  """The paper's Table 1 evaluated beside the measurement (elements = float32 words)."""
  head = ("| P | n | method | paper latency (rounds) | measured rounds | paper bandwidth "
          "(elements) | measured elements |")
  lines = _header(head)
  for r in (r for r in rows if r["paper_latency_rounds"] is not None):  # methods it costs
    low, high = r["paper_bandwidth_elements"]
    band = f"{low:,.0f}" if low == high else f"[{low:,.0f}, {high:,.0f}]"
    lines.append(f"| {r['devices']} | {r['n']:,} | {r['method']} | "
                 f"{r['paper_latency_rounds']:.1f} | {r['hlo_rounds']} | {band} | "
                 f"{r['hlo_elements']:,} |")
  return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
  """Modeled time (10 GbE) vs P, one line per method, one panel per n."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  sizes = sorted({r["n"] for r in rows})
  fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
  for ax, n in zip(axes[0], sizes):
    for label in dict.fromkeys(r["method"] for r in rows):
      pts = sorted((r["devices"], r["modeled_s"] * 1e3) for r in rows
                   if r["n"] == n and r["method"] == label)
      if pts:
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.set(title=f"n = {n:,}", xlabel="P (workers)", ylabel="modeled time per sync (ms)",
           yscale="log")
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run_selection(args) -> list[dict]:
  """One row per (n, density): seconds per call of each selection and the dense pass.

  SparDL's selection (``core/topk.py``) runs with each method: ``count``, ``radix`` and
  ``sort`` in the two stages of the counting rule, ``sort`` also in one stage. ``default``
  names the one SparDL runs on this backend.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np

  from spardl_jax.core import topk

  def ours(method, one_stage=False):
    def fn(x, k):
      chunk = 1 if one_stage else topk.chunk_size(x.shape[0], k, method="count")
      buf = jnp.pad(x, (0, -(-x.shape[0] // chunk) * chunk - x.shape[0]))[None]
      return topk.block_topk(buf, jnp.zeros((1,), jnp.int32), k, chunk, method=method)[0][0]
    return fn

  candidates = {
      "count": ours("count"),
      "radix": ours("radix"),
      "sort": ours("sort"),
      "sort_one_stage": ours("sort", one_stage=True),
      "top_k": lambda x, k: jax.lax.top_k(jnp.abs(x), k)[1],
      "approx_max_k": lambda x, k: jax.lax.approx_max_k(jnp.abs(x), k)[1],
      "dense_pass": lambda x, k: jnp.abs(x) * 2,
  }

  def default(n, k):
    if topk.default_method() != "sort":
      return topk.default_method()
    return "sort_one_stage" if topk.chunk_size(n, k) == 1 else "sort"

  rows = []
  for n in args.n:
    x = jax.random.normal(jax.random.key(args.seed), (n,), jnp.float32)
    for density in args.densities:
      k = max(1, int(np.ceil(density * n)))
      row = {"n": n, "density": density, "k": k, "backend": jax.default_backend(),
             "default": default(n, k)}
      outputs = {}
      for name, fn in candidates.items():
        compiled = jax.jit(fn, static_argnums=1).lower(x, k).compile()
        outputs[name] = jax.block_until_ready(compiled(x))  # warm-up
        times = []
        for _ in range(args.repeats):
          start = time.perf_counter()
          jax.block_until_ready(compiled(x))
          times.append(time.perf_counter() - start)
        row[f"{name}_s"] = statistics.median(times)
      want = np.sort(np.asarray(outputs["top_k"]))
      row["exact"] = all(np.array_equal(np.asarray(outputs[name]), want)
                         for name in ("count", "radix", "sort", "sort_one_stage"))
      rows.append(row)
      print(format_selection([row]).splitlines()[-1], flush=True)
  return rows


def format_selection(rows: list[dict]) -> str:
  lines = ["| n | density | k | SparDL count (s) | SparDL radix (s) | SparDL sort (s) | sort, "
           "one stage (s) | lax.top_k (s) | lax.approx_max_k (s) | dense pass (s) | top_k / "
           "SparDL default | exact |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    mine = r[f"{r['default']}_s"]
    lines.append(f"| {r['n']:,} | {r['density']:g} | {r['k']:,} | {r['count_s']:.4f} | "
                 f"{r['radix_s']:.4f} | {r['sort_s']:.4f} | {r['sort_one_stage_s']:.4f} | "
                 f"{r['top_k_s']:.4f} | "
                 f"{r['approx_max_k_s']:.4f} | {r['dense_pass_s']:.4f} | "
                 f"{r['top_k_s'] / mine:.1f}x ({r['default']}) | {r['exact']} |")
  return "\n".join(lines)


def _save(args, name: str, **payload) -> bool:
  """Writes ``payload`` and the arguments as ``--out``/``name`` (JSON); False without
  ``--out``."""
  if not args.out:
    return False
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, name), "w") as f:
    json.dump({"args": vars(args), **payload}, f, indent=2)
  return True


def main(argv=None) -> int:
  args = _parse_args(sys.argv[1:] if argv is None else argv)
  if args.selection:
    import jax
    rows = run_selection(args)
    print(f"\nSelection of the top k (one device, {jax.devices()[0].device_kind}, "
          f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}; "
          f"median of {args.repeats})")
    print(format_selection(rows))
    _save(args, "selection.json", rows=rows)
    return 0
  import jax
  if args.emulate:  # one device, whatever the backend
    rows = run_emulated(args)
    print(f"Each sync with P ranks emulated on one {jax.devices()[0].device_kind} "
          f"(jax {jax.__version__}), density {args.density}, median of {args.repeats}")
    print(format_emulated(rows))
    _save(args, "emulated.json", rows=rows)
    return 0
  # Before JAX starts its CPU backend; ignored on GPU hosts, which use their real devices.
  jax.config.update("jax_num_cpu_devices", max(args.devices))
  rows = run(args)
  machine = (f"{platform.machine()}, {os.cpu_count()} cores, {jax.devices()[0].platform}, "
             f"jax {jax.__version__}")
  print(f"All-reduce methods, density {args.density}, median of {args.repeats} ({machine}); "
        f"model alpha={args.alpha:g} s, beta={args.beta:g} s/B; "
        f"* = the d teams='auto' picks")
  print(format_table(rows))
  print("\nThe paper's Table 1 beside the measurement")
  print(format_table1(rows))
  if _save(args, "results.json", machine=machine, rows=rows):
    plot(rows, os.path.join(args.out, "modeled_time.png"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
