"""Time to accuracy against P: the steps each method needs at each P (runs of ``python -m
train --devices P``) times its projected time per step (``python -m benchmarks.project``).

Usage::

  python -m benchmarks.scale --runs benchmarks/results/scale/steps/mnist1d \\
      --projection benchmarks/results/scale/vgg16 --model vgg16 --target 0.98 \\
      --out benchmarks/results/scale/tta/mnist1d_vgg16

``--runs`` names folders; every ``metrics.json`` under them is one ``python -m train`` run
(one P, one seed, several variants). At each P the target is ``--target`` of dense's final
test metric (mean over the seeds at that P); a variant's steps are the mean over seeds of the
first test (each epoch's end) at or above it, and "never" if a seed never gets there.

The time per step of a variant at P on a link is the projection's model: the model's step
(the projection's ``step_ms``) plus the sync's measured compute (its ``compute``) plus the
variant's formula (at its own density) on the link, for the ``n`` of ``--model``, whose
matrix shapes PowerSGD's bytes also need. A method without a measured compute is projected
with none: its time is a lower bound, marked ``≥``; "first" is the first of the methods with
a measured compute, and each lower bound that beats it is named with the compute per sync
under which it would be first instead. Each sparse method is compared twice: at 1 % (the
fixed density) and at its best density (the least time to the target at that P and link).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from spardl_jax import methods
from benchmarks import convergence, project, runs
from benchmarks.cli import FRACTIONS

__all__ = ["load_runs", "steps_table", "across_targets", "time_rows", "first_rows", "crossover",
           "main"]

FIXED_DENSITY = 0.01


def load_runs(folders: list[str]) -> dict[int, dict[str, dict]]:
  """``{P: {label: {"method", "options", "curves": {seed: [(steps, test metric)]}}}}`` from
  every ``metrics.json`` under ``folders``; a (P, seed, label) met twice (dense, run again
  beside other variants) keeps its first run."""
  try:
    found = runs.find(folders)
  except ValueError as error:
    raise ValueError(f"--runs: {error}") from None
  by_p: dict[int, dict[str, dict]] = {}
  for run in found:
    entry = by_p.setdefault(run.devices, {}).setdefault(
        run.label, {"method": run.method, "options": run.options, "curves": {}, "bytes": {}})
    entry["curves"].setdefault(run.seed, run.curve())
    entry["bytes"].setdefault(run.seed, run.bytes_per_step)
  return by_p


def steps_table(by_p: dict[int, dict[str, dict]], fraction: float) -> list[runs.RowAtP]:
  """One row per (P, label): the target, each seed's steps to it (None: never) and over
  dense's at that P, and the final."""
  rows = []
  for p, labels in sorted(by_p.items()):
    if "dense" not in labels:
      raise ValueError(f"--runs: no dense run at P = {p}; dense sets the target")
    goal = runs.target([c[-1][1] for c in labels["dense"]["curves"].values()], fraction)
    for label, entry in labels.items():
      seeds = sorted(entry["curves"])
      steps = [(runs.first_reaching(entry["curves"][seed], goal) or (None,))[0]
               for seed in seeds]
      rows.append(runs.RowAtP(
          f"P = {p}", label, label, "accuracy", steps,
          [entry["curves"][seed][-1][1] for seed in seeds],
          float(np.mean([entry["bytes"][s] for s in seeds])), fraction, seeds=seeds,
          target=goal, p=p, method=entry["method"], options=entry["options"]))
  dense = {r.p: r.mean_steps for r in rows if r.key == "dense"}
  for r in rows:
    mean, base = r.mean_steps, dense[r.p]
    r.steps_ratio = mean / base if mean and base else None
  return rows


def only(steps: list[runs.RowAtP], labels: list[str] | None) -> list[runs.RowAtP]:
  """:func:`steps_table`'s rows of ``labels`` alone, in that order at each P (None: all); a
  ValueError naming a label no run has, and the labels there are."""
  if labels is None:
    return steps
  known = list(dict.fromkeys(r.key for r in steps))
  missing = [label for label in labels if label not in known]
  if missing:
    raise ValueError(f"--variants: no runs of {', '.join(map(repr, missing))}; the runs have "
                     f"{', '.join(known)}")
  return sorted((r for r in steps if r.key in labels),
                key=lambda r: (r.p, labels.index(r.key)))


def against_p(steps: list[runs.RowAtP], *, fraction: float, title: str) -> str:
  """The Markdown of steps to the target against P, each variant's mean × dense's mean at
  that P, then its final metric and bytes per step (means over the seeds)."""
  labels = list(dict.fromkeys(r.key for r in steps))
  by = {(r.p, r.key): r for r in steps}
  ps = sorted({r.p for r in steps})
  seeds = sorted({s for r in steps for s in r.seeds or ()})
  lines = [f"# Steps to {fraction:.0%} of dense's final metric against P: {title}", "",
           f"Mean over seeds {seeds} (× dense's mean at that P; \"never\" if a seed never got "
           "there).", "", "| P | " + " | ".join(labels) + " |",
           "| --- |" + " --- |" * len(labels)]
  for p in ps:
    cells = []
    for label in labels:
      r = by.get((p, label))
      if r is None:
        cells.append("")
      elif r.mean_steps is None:
        cells.append(f"never ({r.seed_steps})")
      else:
        cells.append(f"{r.mean_steps:.0f}"
                     + (f" ({r.steps_ratio:.2f}×)" if r.steps_ratio is not None else ""))
    lines.append(f"| {p} | " + " | ".join(cells) + " |")
  lines += ["", "Final test metric, and bytes per step per device:", "",
            "| P | " + " | ".join(labels) + " |", "| --- |" + " --- |" * len(labels)]
  for p in ps:
    cells = [f"{by[(p, l)].mean_final:.3f}, {by[(p, l)].bytes_per_step:,.0f} B"
             if (p, l) in by else "" for l in labels]
    lines.append(f"| {p} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def across_targets(by_target: list[list[runs.RowAtP]]) -> str:
  """One line per (P, variant) across the targets (:func:`steps_table`'s rows at each, in
  the same order), as convergence's reports write them: steps to each target (per seed) and
  over dense's at that P, the final test metric (per seed), the bytes a step and dense's over
  them."""
  return convergence.targets_table(by_target) + "\n"


def _bound(method_name: str, options: dict, shapes, p: int):
  """The method on ``p`` devices, bound to the model's leaf shapes if it works per leaf
  (PowerSGD)."""
  method = methods.make(method_name, p=p, **options)
  return method.for_leaves(shapes) if method.leafwise else method


def time_rows(steps: list[runs.RowAtP], projection: dict, shapes,
              alpha_scale: float = 1.0) -> list[dict]:
  """Each steps row on each of the projection's links (latency per round times
  ``alpha_scale``): seconds to the target, the sync compute used and where it comes from
  (measured at that P, another P's figure, an estimate, or none: a lower bound)."""
  args = projection["args"]
  estimated = args.get("estimated") or {}
  n = sum(int(np.prod(s)) for s in shapes)
  out = []
  for row in steps:
    method = _bound(row.method, row.options, shapes, row.p)
    table = args["compute"] if row.method in args["compute"] else estimated
    ms, source = (project.compute_at(table, row.method, row.p)
                  if row.method in table else (0.0, "none"))
    for link in args["links"].split(","):
      step_s = project.step_seconds(method, p=row.p, n=n,
                                    link=project.link(link, alpha_scale),
                                    compute_s=ms / 1e3, step_s=args["step_ms"] / 1e3)
      out.append({**row.to_json(), "link": link, "step_s": step_s, "compute_ms": ms,
                  "compute_from": source, "lower_bound": source == "none",
                  "estimated": row.method in estimated,
                  "seconds": None if row.mean_steps is None else row.mean_steps * step_s})
  return out


def first_rows(times: list[dict]) -> list[dict]:
  """Per (link, P): each method's seconds at 1 % and at its best density (None: never at the
  target); ``first_<kind>``, the first of the methods whose compute was measured; and
  ``contenders_<kind>``, each method projected without its compute (a lower bound) that
  beats that first, with the sync compute in ms under which it would be first instead."""
  out = []
  links = list(dict.fromkeys(r["link"] for r in times))
  for link, p in sorted({(r["link"], r["p"]) for r in times},
                        key=lambda lp: (links.index(lp[0]), lp[1])):
    here = [r for r in times if r["link"] == link and r["p"] == p]
    fixed: dict[str, dict] = {}
    best: dict[str, dict] = {}
    for r in here:
      if r["options"].get("density") in (None, FIXED_DENSITY):
        fixed[r["method"]] = r
      old = best.get(r["method"])
      if old is None or (r["seconds"] is not None and (
          old["seconds"] is None or r["seconds"] < old["seconds"])):
        best[r["method"]] = r
    row = {"link": link, "p": p,
           "lower_bound": sorted({r["method"] for r in here if r["lower_bound"]}),
           "estimated": sorted({r["method"] for r in here if r["estimated"]}),
           "extrapolated": sorted({r["method"] for r in here
                                   if "extrapolated" in r["compute_from"]})}
    for kind, chosen in (("fixed", fixed), ("best", best)):
      row[kind] = {m: (r["seconds"], r["options"].get("density")) for m, r in chosen.items()}
      reached = {m: r for m, r in chosen.items() if r["seconds"] is not None}
      measured = [m for m in reached if not reached[m]["lower_bound"]]
      first = min(measured, key=lambda m: reached[m]["seconds"]) if measured else None
      row[f"first_{kind}"] = first
      # Each step of a contender may compute this long and still reach the target first.
      row[f"contenders_{kind}"] = {
          m: (reached[first]["seconds"] - r["seconds"]) / r["mean_steps"] * 1e3
          for m, r in reached.items()
          if first is not None and r["lower_bound"]
          and r["seconds"] < reached[first]["seconds"]}
    out.append(row)
  return out


def crossover(firsts: list[dict], kind: str, method: str = "spardl") -> dict[str, int | None]:
  """Per link, the least measured P from which ``method`` is first (among the methods with a
  measured compute) at every larger measured P (None: not first at the largest)."""
  out: dict[str, int | None] = {}
  for link in dict.fromkeys(f["link"] for f in firsts):
    since = None
    for f in sorted((f for f in firsts if f["link"] == link), key=lambda f: -f["p"]):
      if f[f"first_{kind}"] != method:
        break
      since = f["p"]
    out[link] = since
  return out


def _model_shapes(name: str):
  import jax

  from models import registry
  params = registry.abstract_params(registry.create(name), registry.spec(name).example)
  return [tuple(leaf.shape) for leaf in jax.tree.leaves(params)]


def _fmt(seconds, mark: str = "") -> str:
  return "never" if seconds is None else f"{mark}{seconds:.2f}"


def _density(density) -> str:
  return density if isinstance(density, str) else f"{density:.1%}"  # "auto": the rule's


def report(steps: list[runs.RowAtP], times: list[dict], firsts: list[dict], *,
           fraction: float, title: str) -> str:
  """The Markdown of the three tables: steps, time to target at 1 %, and at the best density."""
  lines = [f"# Time to {fraction:.0%} of dense's final metric: {title}", "",
           "## Steps to the target (mean over seeds; per seed in brackets) and final metric", "",
           "| P | variant | steps | final |", "| --- | --- | --- | --- |"]
  for r in steps:
    mean = "never" if r.mean_steps is None else f"{r.mean_steps:.0f}"
    final = ", ".join(f"{f:.3f}" for f in r.final)
    lines.append(f"| {r.p} | {r.key} | {mean} ({r.seed_steps}) | {final} |")
  lower = sorted({m for f in firsts for m in f["lower_bound"]})
  guessed = sorted({m for f in firsts for m in f["estimated"]})
  note = " ".join(filter(None, [
      f"≥: {', '.join(lower)} projected without a sync compute (a lower bound); \"first\" is "
      "among the methods with one, and names each lower bound that beats it with the compute "
      "per sync it would have to stay under." if lower else "",
      f"~: {', '.join(guessed)} with an estimated sync compute, not measured on the target "
      "(\"first\" says so where one wins)." if guessed else "",
      "†: the method's compute at that P is another P's figure (extrapolated)."
      if any(f["extrapolated"] for f in firsts) else ""]))
  for kind, heading in (("fixed", "each sparse method at 1 %"),
                        ("best", "each sparse method at its best density")):
    names = list(dict.fromkeys(m for f in firsts for m in f[kind]))
    lines += ["", f"## Projected seconds to the target, {heading}", "", note, "",
              "| link | P | " + " | ".join(names) + " | first |",
              "| --- | --- | " + "--- | " * len(names) + "--- |"]
    for f in firsts:
      cells = []
      for m in names:
        if m not in f[kind]:
          cells.append("")  # not run at this P
          continue
        seconds, density = f[kind][m]
        cell = _fmt(seconds, "≥" if m in f["lower_bound"] else "~" if m in f["estimated"]
                    else "") + ("†" if m in f["extrapolated"] and seconds is not None else "")
        shown = kind == "best" and density is not None and seconds is not None
        cells.append(cell + (f" @{_density(density)}" if shown else ""))
      contenders = "".join(f"; {m} if its sync computes < {ms:.2f} ms"
                           for m, ms in f[f"contenders_{kind}"].items())
      first = f["first_" + kind]
      lines.append(f"| {f['link']} | {f['p']} | " + " | ".join(cells) +
                   f" | {first}{' (estimated compute)' if first in f['estimated'] else ''}"
                   f"{contenders} |")
    since = crossover(firsts, kind)
    lines += ["", "SparDL first (among the methods with a compute) at every measured P from: " + ", ".join(
        f"{link} {'P = ' + str(p) if p else 'none'}" for link, p in since.items()) + "."]
  return "\n".join(lines) + "\n"


def alpha_table(firsts: list[dict], sensitivity: dict) -> str:
  """The first at each method's best density with alpha as assumed and scaled, per (link,
  P); the cells whose first changes are in bold."""
  scales = sorted({*sensitivity, 1.0})
  lines = ["", "## Sensitivity to alpha (the latency per round, assumed)", "",
           "First at each method's best density with every link's alpha scaled; a first that "
           "differs from alpha's own (× 1) is in bold.", "",
           "| link | P | " + " | ".join(f"alpha × {k:g}" for k in scales) + " |",
           "| --- | --- | " + "--- | " * len(scales)]
  for i, f in enumerate(firsts):
    own = f["first_best"]
    cells = [own if k == 1.0 else sensitivity[k][i]["first_best"] for k in scales]
    lines.append(f"| {f['link']} | {f['p']} | "
                 + " | ".join(f"**{c}**" if c != own else str(c) for c in cells) + " |")
  changed = sum(sensitivity[k][i]["first_best"] != f["first_best"]
                for k in sensitivity for i, f in enumerate(firsts))
  lines += ["", f"{changed} of {len(firsts) * len(sensitivity)} scaled cells change first."]
  return "\n".join(lines) + "\n"


def _plot(firsts: list[dict], path: str, *, title: str) -> None:
  series = {}
  for f in firsts:
    lines = series.setdefault(f["link"], {})
    for method, (seconds, _) in f["best"].items():
      lines.setdefault(method, [])
      if seconds is not None:
        lines[method].append((f["p"], seconds))
  project.plot_against_p(series, path, title=title, ylabel="s to target")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--runs", required=True,
                      help="comma list of folders holding python -m train runs (metrics.json)")
  parser.add_argument("--projection",
                      help="a python -m benchmarks.project --out folder (projection.json); "
                           "without it, the steps against P alone")
  parser.add_argument("--model",
                      help="the projected model (its shapes for PowerSGD, its n), e.g. vgg16")
  parser.add_argument("--target", type=FRACTIONS, default=[0.98],
                      help="fraction of dense's final test metric (default 0.98); without "
                           "--projection a comma list adds a table of each variant's steps "
                           "to each")
  parser.add_argument("--variants", type=lambda text: text.split(","), default=None,
                      help="without --projection: only these labels (a comma list, e.g. "
                           "dense,spardl,topka), in this order; default: every run's")
  parser.add_argument("--title", default="")
  parser.add_argument("--alpha-scales", type=lambda text: [float(v) for v in text.split(",")],
                      default=[], help="also project with every link's latency per round "
                      "times each of these (e.g. 0.1,10) and list the cells whose first "
                      "changes: alpha is an assumption, not a measurement")
  parser.add_argument("--out", help="folder for results.json, results.md and tta.png")
  args = parser.parse_args(argv)
  if args.projection is None:
    try:
      by_p = load_runs(args.runs.split(","))
      by_target = [only(steps_table(by_p, target), args.variants) for target in args.target]
    except ValueError as error:
      parser.error(str(error))
    print("\n".join(against_p(steps, fraction=target, title=args.title or args.runs)
                    for steps, target in zip(by_target, args.target))
          + (f"\n{across_targets(by_target)}" if len(by_target) > 1 else ""))
    return 0
  if len(args.target) > 1:
    parser.error("--target: one fraction with --projection (a time to accuracy is of one "
                 "target)")
  args.target = args.target[0]
  if args.model is None:
    parser.error("--projection needs --model (the projected model's shapes and n)")
  path = os.path.join(args.projection, "projection.json")
  if not os.path.isfile(path):
    parser.error(f"--projection: no projection.json in {args.projection!r}; write one with "
                 f"python -m benchmarks.project --out")
  with open(path) as f:
    projection = json.load(f)
  try:
    shapes = _model_shapes(args.model)
    steps = steps_table(load_runs(args.runs.split(",")), args.target)
  except ValueError as error:
    parser.error(str(error))
  times = time_rows(steps, projection, shapes)
  firsts = first_rows(times)
  title = args.title or projection["args"].get("title") or args.model
  text = report(steps, times, firsts, fraction=args.target, title=title)
  sensitivity = {scale: first_rows(time_rows(steps, projection, shapes, alpha_scale=scale))
                 for scale in args.alpha_scales}
  if sensitivity:
    text += alpha_table(firsts, sensitivity)
  print(text)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.md"), "w") as f:
      f.write(text)
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump({"args": vars(args), "title": title,
                 "steps": [r.to_json() for r in steps], "times": times,
                 "first": firsts,
                 "first_at_alpha": {str(k): v for k, v in sensitivity.items()},
                 "crossover": {kind: crossover(firsts, kind) for kind in ("fixed", "best")}},
                f, indent=2)
    _plot(firsts, os.path.join(args.out, "tta.png"), title=title)
  return 0


if __name__ == "__main__":
  sys.exit(main())
