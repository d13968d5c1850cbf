"""Projected time of one sync, and of one train step, on P workers: the alpha-beta model with
measured compute.

Usage::

  python -m benchmarks.project --n 14.7e6 --step-ms 4.1 \\
      --compute dense=0.07,spardl=2.2,oktopk=1.1,topka=7.9 --links 100mbit,10gbe,ib100 \\
      --p 2,4,8,16,32,64,128,256,512,1024 --out scale_out
  python -m benchmarks.project --validate netbench_out/results.json

For a method at ``P`` workers and ``n`` gradient entries:

  t_sync = c + rounds * alpha + max(0, bytes - burst) * beta,  t_step = t_compute + t_sync

``rounds`` and ``bytes`` (the busiest device's) are the method's ``formula``, which the tests
hold to the compiled HLO; ``c`` is the sync's measured compute on one device (``--compute``,
milliseconds, e.g. from ``spardl-bench --emulate`` on the target GPU), taken as independent
of ``P``; ``t_compute`` the model's forward and backward (``--step-ms``). Communication is not
overlapped with the backward pass. ``burst`` is a token bucket's depth: 0 for a real link,
the bytes a ``tc tbf`` shaper lets through at once for the emulated network (its run records
it per rate: netbench's is rate / HZ; 4 MiB in runs from before it recorded one).

``--validate`` checks the model against a ``python -m benchmarks.netbench`` run that timed
every method unshaped and shaped: the unshaped time is the measured ``c`` (compute plus the
software's per-round latency), and each shaped time is predicted from it with nothing fitted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import NamedTuple

from benchmarks.netbench import SHAPER, rate_bits
from spardl_jax import cost as cost_model

__all__ = ['Link', 'LINKS', 'OLD_TBF_BURST', 'sync_seconds', 'step_seconds', 'project', 'validate',
           'per_step', 'plot_against_p', 'main']


class Link(NamedTuple):
  """A network: ``alpha`` seconds per round, ``beta`` seconds per byte, and a token bucket of
  ``burst`` bytes sent at once (0 on a real link)."""

  alpha: float
  beta: float
  burst: float = 0.0


# Ethernet's latency per round is the library's 10 GbE figure at every rate (the cost model's
# defaults, core/config.py); InfiniBand's is its own.
ETHERNET_ALPHA = cost_model.ETHERNET_10G["alpha"]
LINKS = {
    "100mbit": Link(ETHERNET_ALPHA, 8 / 100e6),
    "1gbe": Link(ETHERNET_ALPHA, 8 / 1e9),
    "10gbe": Link(ETHERNET_ALPHA, cost_model.ETHERNET_10G["beta"]),
    "25gbe": Link(ETHERNET_ALPHA, 8 / 25e9),
    "ib100": Link(cost_model.INFINIBAND_100G["alpha"], cost_model.INFINIBAND_100G["beta"]),
}
# netbench's `tc tbf ... burst 4mb` (tc's mb is MiB) before its runs recorded their bucket:
# the results of those runs (benchmarks/results/) are validated with it.
OLD_TBF_BURST = 4 * 2**20


def _method(spec: str, density: float, p: int):
  """A method from its spec (``spardl``, ``spardl:wire=exact``, ``spardl:density=auto``) on
  ``p`` devices, at ``density`` unless the spec gives one."""
  from spardl_jax import options
  return options.parse(spec, density=density).build(p)


def sync_seconds(method, *, p: int, n: int, link: Link, compute_s: float,
                 itemsize: int = 4) -> float:
  """One sync's projected seconds: ``compute_s`` plus the method's formula on ``link``."""
  c = method.formula(p=p, n=n, itemsize=itemsize)
  sent = max(0.0, float(c.bytes) - link.burst)
  return compute_s + cost_model.modeled_seconds(c._replace(bytes=sent), alpha=link.alpha,
                                                beta=link.beta)


def step_seconds(method, *, p: int, n: int, link: Link, compute_s: float, step_s: float,
                 itemsize: int = 4) -> float:
  """One train step's projected seconds: the model's ``step_s`` then the sync."""
  return step_s + sync_seconds(method, p=p, n=n, link=link, compute_s=compute_s,
                               itemsize=itemsize)


def link(name: str, alpha_scale: float = 1.0) -> Link:
  """The link ``name`` with its latency per round times ``alpha_scale`` (the sensitivity of
  a projection to an alpha nobody measured)."""
  found = LINKS[name]
  return found._replace(alpha=found.alpha * alpha_scale)


def project(*, n: int, density: float, compute_ms: dict, step_ms: float, links, ps,
            alpha_scale: float = 1.0) -> list:
  """Rows ``{method, link, p, compute_ms, compute_from, sync_s, step_s}`` for every method
  of ``compute_ms`` (``{method: {P: ms}}``, :func:`compute_at`)."""
  rows = []
  for name in compute_ms:
    for link_name in links:
      for p in ps:
        ms, source = compute_at(compute_ms, name, p)
        sync = sync_seconds(_method(name, density, p), p=p, n=n,
                            link=link(link_name, alpha_scale), compute_s=ms / 1e3)
        rows.append({"method": name, "link": link_name, "p": p, "compute_ms": ms,
                     "compute_from": source, "sync_s": sync, "step_s": step_ms / 1e3 + sync})
  return rows


def validate(results: dict, *, p: int, n: int, density: float) -> list:
  """Predicted against measured seconds for every shaped rate of a run that also ran
  unshaped: ``{rate: {method: {"seconds": median, "bytes": optional}}}`` of ``p`` processes,
  ``n`` entries, and the shaper's bucket under ``"shaper"`` (a netbench ``results.json`` is
  one; :func:`per_step` makes one of a time-to-accuracy run). The unshaped time is the
  compute, nothing is fitted; a timing with ``bytes`` (the run's own bytes per step) is
  charged those, else the method's formula."""
  results = dict(results)
  burst = results.pop(SHAPER, {}).get("tbf_burst_bytes", OLD_TBF_BURST)
  # netbench's bucket is one per rate (rate / HZ); runs shaped with one bucket for all rates
  # recorded a number.
  burst_at = burst.__getitem__ if isinstance(burst, dict) else lambda rate: burst
  if "unshaped" not in results:
    raise ValueError("--validate needs a netbench run with the rate 'unshaped' (--rates "
                     "unshaped,1gbit,100mbit).")
  rows = []
  for rate, by_method in results.items():
    if rate == "unshaped":
      continue
    link = Link(0.0, 8 / rate_bits(rate), burst_at(rate))
    for label, timing in by_method.items():
      unshaped = results["unshaped"][label]["seconds"]
      if "bytes" in timing:
        predicted = unshaped + max(0.0, timing["bytes"] - link.burst) * link.beta
      else:
        predicted = sync_seconds(_method(label, density, p), p=p, n=n, link=link,
                                 compute_s=unshaped)
      rows.append({"rate": rate, "method": label, "measured_s": timing["seconds"],
                   "unshaped_s": unshaped, "predicted_s": predicted,
                   "error": predicted / timing["seconds"] - 1})
  return rows


def per_step(tta: dict, seed: int) -> dict:
  """A ``python -m benchmarks.time_to_accuracy`` ``results.json`` as :func:`validate`'s input:
  each method's mean seconds per train step at each rate for ``seed``, with its bytes per
  step (the run's bytes over its steps)."""
  steps = tta["args"]["epochs"] * tta["args"]["steps_per_epoch"]
  out: dict = {SHAPER: {"tbf_burst_bytes": tta["args"].get("tbf_burst_bytes", OLD_TBF_BURST)}}
  for row in tta["rows"]:
    if row["seed"] == seed:
      out.setdefault(row["rate"], {})[row["method"]] = {
          "seconds": row["seconds_per_step"], "bytes": row["bytes_per_device"] / steps}
  return out


def fastest_table(rows: list[dict], title: str) -> str:
  """The Markdown table of the fastest method per iteration at each (link, P) of
  :func:`project`'s rows (an estimated compute marked ~, another P's figure †)."""
  links = list(dict.fromkeys(r["link"] for r in rows))
  ps = sorted({r["p"] for r in rows})
  lines = [f"Fastest per iteration, {title} (~: estimated compute; †: another P's figure):", "",
           "| link | " + " | ".join(f"P = {p}" for p in ps) + " |",
           "| --- |" + " --- |" * len(ps)]
  for link_name in links:
    cells = []
    for p in ps:
      best = min((r for r in rows if r["link"] == link_name and r["p"] == p),
                 key=lambda r: r["step_s"])
      mark = ("~" if best.get("estimated") else "") + (
          "†" if "extrapolated" in best.get("compute_from", "") else "")
      cells.append(f"{best['method']}{mark} {best['step_s'] * 1e3:.1f} ms")
    lines.append(f"| {link_name} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def _compute(text: str) -> dict:
  """``--compute``: ``method=ms`` (at every P) or ``method=P:ms/P:ms`` (measured at each of
  those P) pairs -> ``{method: {P: ms}}`` (P 0: every P)."""
  out: dict = {}
  for part in text.split(","):
    name, _, value = part.partition("=")
    at: dict = {}
    try:
      for item in value.split("/"):
        p, sep, ms = item.rpartition(":")
        at[int(p) if sep else 0] = float(ms)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"{text!r}: give method=milliseconds pairs (or method=P:ms/P:ms), e.g. "
          f"spardl=8:5.1/16:2.24,dense=0.07 (bad part {part!r})") from None
    if any(not math.isfinite(ms) or ms < 0 for ms in at.values()) or any(p < 0 for p in at):
      raise argparse.ArgumentTypeError(f"{part!r}: the milliseconds must be >= 0")
    out[name] = at
  return out


def compute_at(table: dict, method: str, p: int) -> tuple[float, str]:
  """``(ms, where it comes from)`` of ``method``'s sync compute at ``p`` in a ``--compute``
  table (``{method: {P: ms}}``, JSON's string keys or a bare number from older runs too):
  the figure measured at ``p``; else the one at the nearest measured P below it (or above,
  when none is below), said to be extrapolated."""
  at = table[method]
  if not isinstance(at, dict):
    return float(at), "one figure for every P"
  at = {int(k): v for k, v in at.items()}
  if p in at:
    return at[p], f"measured at P = {p}"
  if 0 in at:
    return at[0], "one figure for every P"
  below = [q for q in at if q < p]
  q = max(below) if below else min(at)
  return at[q], f"P = {q}'s figure (extrapolated)"


def plot_against_p(series: dict, path: str, *, title: str, ylabel: str) -> None:
  """One log-log panel per link, one line per method: ``series`` is ``{link: {method:
  [(P, value), ...]}}``."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.6), squeeze=False)
  for ax, (link, lines) in zip(axes[0], series.items()):
    ps = sorted({p for pts in lines.values() for p, _ in pts})
    for method, pts in lines.items():
      if pts:
        ax.plot(*zip(*pts), marker="o", ms=3, label=method)
    ax.set(xscale="log", yscale="log", xlabel="P (workers)", ylabel=ylabel,
           title=f"{title}, {link}")
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # only the P measured
    ax.set_xticks(ps, [str(p) for p in ps])
    ax.grid(True, which="both", alpha=0.3)
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.project", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--n", type=lambda v: int(float(v)), default=14_700_000)
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--step-ms", type=float, default=0.0,
                      help="the model's forward and backward on one device, ms")
  parser.add_argument("--compute", type=_compute, default={"dense": {0: 0.0},
                                                          "spardl": {0: 0.0}},
                      help="method=ms of one sync's compute on one device, or "
                           "method=P:ms/P:ms measured at those P (others take the nearest "
                           "P below, marked extrapolated)")
  parser.add_argument("--estimated", type=_compute, default={},
                      help="the same for methods whose compute was not measured on the "
                           "target but estimated (PowerSGD, gTopk); marked ~ in tables")
  parser.add_argument("--alpha-scale", type=float, default=1.0,
                      help="every link's latency per round times this (default 1): alpha "
                           "is an assumption, not a measurement")
  parser.add_argument("--links", default="100mbit,10gbe,25gbe,ib100",
                      help=f"comma list of {', '.join(LINKS)}")
  parser.add_argument("--p", default="2,4,8,16,32,64,128,256,512,1024")
  parser.add_argument("--title", default="")
  parser.add_argument("--validate", help="a netbench results.json (unshaped and shaped rates; "
                      "with --processes, --n and --density as it ran)")
  parser.add_argument("--processes", type=int, default=4, help="netbench's, for --validate")
  parser.add_argument("--seed", type=int, default=0,
                      help="with --validate on a time-to-accuracy results.json: the seed that "
                      "ran unshaped")
  parser.add_argument("--out", help="directory for projection.json and projection.png")
  args = parser.parse_args(argv)
  if args.validate:
    try:
      with open(args.validate) as f:
        data = json.load(f)
    except OSError as error:
      parser.error(f"--validate {args.validate!r} cannot be read: {error.strerror or error}")
    except json.JSONDecodeError as error:
      parser.error(f"--validate {args.validate!r} is not a results.json: {error}")
    if "rows" in data:  # a time-to-accuracy run: per train step, its own bytes
      data = per_step(data, args.seed)
    try:
      rows = validate(data, p=args.processes, n=args.n, density=args.density)
    except ValueError as error:
      parser.error(str(error))
    print("| rate | method | unshaped (s) | measured (s) | predicted (s) | error |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
      print(f"| {r['rate']} | {r['method']} | {r['unshaped_s']:.3f} | {r['measured_s']:.3f} | "
            f"{r['predicted_s']:.3f} | {r['error']:+.0%} |")
    close = sum(abs(r["error"]) <= 0.25 for r in rows)
    print(f"\n{close} of {len(rows)} within ±25 %")
    return 0
  links = args.links.split(",")
  for link in links:
    if link not in LINKS:
      parser.error(f"--links: unknown {link!r}; choose from {', '.join(LINKS)}")
  try:
    ps = [int(p) for p in args.p.split(",")]
  except ValueError:
    parser.error(f"--p must be a comma list of ints, got {args.p!r}")
  if min(ps) < 1:
    parser.error(f"--p must be >= 1, got {args.p!r}")
  try:
    rows = project(n=args.n, density=args.density,
                   compute_ms={**args.compute, **args.estimated}, step_ms=args.step_ms,
                   links=links, ps=ps, alpha_scale=args.alpha_scale)
    for row in rows:
      row["estimated"] = row["method"] in args.estimated
  except (ValueError, TypeError) as error:
    parser.error(str(error))
  for link in links:
    print(f"\n{link}: ms per iteration")
    names = list({**args.compute, **args.estimated})
    print("| P | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 1))
    for p in ps:
      cells = [f"{r['step_s'] * 1e3:.1f}" for name in names for r in rows
               if r["method"] == name and r["link"] == link and r["p"] == p]
      print(f"| {p} | " + " | ".join(cells) + " |")
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "projection.json"), "w") as f:
      json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    with open(os.path.join(args.out, "fastest.md"), "w") as f:
      f.write(fastest_table(rows, args.title or f"n = {args.n:,}"))
    series = {link: {name: [(r["p"], r["step_s"] * 1e3) for r in rows
                            if r["link"] == link and r["method"] == name]
                     for name in {**args.compute, **args.estimated}} for link in links}
    plot_against_p(series, os.path.join(args.out, "projection.png"),
                   title=args.title or f"n = {args.n:,}", ylabel="ms per iteration")
  return 0


if __name__ == "__main__":
  sys.exit(main())
