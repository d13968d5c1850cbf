"""Every all-reduce method side by side on simulated CPU devices (``spardl-bench``'s default):
the traffic of each from its compiled HLO against its formula and the paper's Table 1, the
time of one call, and the alpha-beta model's time on 10 Gbit/s Ethernet and InfiniBand."""

from __future__ import annotations

import os

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spardl_jax._src.core import cost
from spardl_jax._src.sync import registry as methods
from spardl_jax.tools import traffic
from spardl_jax.tools.bench.common import median_seconds, variants

__all__ = ['run', 'format_table', 'format_table1', 'plot']


def run(args) -> list[dict]:
  """One row per (P, n, method variant): the rounds and bytes a device sends, read from the
  compiled HLO, beside the method's formula and the paper's Table 1; the median time of one
  call when its arrays fit in ``--max-memory-gb``; the alpha-beta modeled times."""
  from spardl_jax.tools.progress import bar

  rows = []
  axis = "data"
  jobs = [(p, n) for p in args.devices for n in args.n]
  for p, n in bar(jobs, desc="configurations", unit="cfg", enabled=not args.no_progress):
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
    for label, method, d in variants(args, p):
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
        seconds = median_seconds(compiled, x, state, args.repeats)
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
