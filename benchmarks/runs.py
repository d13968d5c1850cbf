"""What the benchmarks read of training runs, the rows their tables are formatted from
(:class:`Runs`, :class:`Row`, :class:`RowAtP`), and when a run reaches a target.

Every driver reads ``python -m train`` runs through :func:`read` and :func:`find`: each run's
``metrics.json`` as :mod:`train.report` writes it, or kept with the experiment's other runs
in one ``runs.json`` (:func:`bundle`, ``python -m benchmarks.runs --bundle FOLDER``). They
measure "steps (or seconds) to a fraction of dense's final metric" with :func:`target` and
:func:`first_reaching`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from spardl_jax.tools.provenance import provenance
from train import lock, report
RunRecord = report.RunRecord

__all__ = ['RunRecord', 'Runs', 'Row', 'RowAtP', 'BUNDLE', 'bundle', 'lookup', 'read', 'find',
           'target', 'first_reaching', 'provenance', 'write_rows']

Point = TypeVar("Point")
R = TypeVar("R", bound="Row")
# A run's evaluations in order, each (steps, bytes each device sent, test metric, test loss).
Curve = list[tuple[int, float, float, float]]
RUNS_FIELDS = ("case", "key", "variant", "metric", "bytes_per_step", "curves")


@dataclasses.dataclass
class Runs:
  """One variant's runs of one case, a curve a seed: what a row of a convergence
  ``results.json`` records (a report's rows hold more, which :class:`Row` recomputes).

  Attributes:
    case, key, variant: the case, the variant's key and its label.
    metric: the test metric's name (``accuracy``, ``mae``...).
    bytes_per_step: what the run recorded (:attr:`run_mean_bytes` is what tables use).
    curves: one :data:`Curve` a seed.
    seeds: the seeds, in the curves' order; None where the run did not record them.
  """
  case: str
  key: str
  variant: str
  metric: str
  bytes_per_step: float
  curves: list[Curve]
  seeds: list[int] | None = None

  @classmethod
  def from_json(cls, row: dict, seeds: list[int] | None = None) -> Runs:
    """A ``results.json`` row; ``seeds``: the file's, taken when the row records none and
    holds a curve a seed."""
    return cls(**{field: row[field] for field in RUNS_FIELDS}, seeds=row.get("seeds") or (
        seeds if seeds and len(seeds) == len(row["curves"]) else None))

  @property
  def run_mean_bytes(self) -> float:
    """Bytes a step, each device's mean over the whole run (a dense warm-up included), from
    the curves' last points; the recorded :attr:`bytes_per_step` where a curve is empty (the
    first runs recorded the sparse steps' bytes there, not the run's mean)."""
    if not all(curve and curve[-1][0] for curve in self.curves):
      return self.bytes_per_step
    return float(np.mean([curve[-1][1] / curve[-1][0] for curve in self.curves]))


@dataclasses.dataclass
class Row:
  """One variant of one case (or one P) at one target: what every table of the lab is
  formatted from.

  Attributes:
    case, key, variant, metric: as :class:`Runs`'s (``case`` may be ``"P = 8"``).
    steps: per seed, the steps to the target; None where a seed never reached it.
    final: per seed, the final test metric (``on="metric"``) or loss (``on="loss"``).
    bytes_per_step: each device's mean over the whole run.
    fraction: the target, a fraction of dense's mean final (a loss: ``2 - fraction`` times).
    on: ``"metric"`` or ``"loss"``.
    seeds: the seeds, as the runs recorded them.
    target: the target's value.
    steps_ratio, steps_ratio_best: the mean steps over dense's, and over the faster of
      dense and tuned dense; None where either never got there.
    bytes_to_target, bytes_ratio: the mean bytes sent to the target, and over dense's.
    curves: the runs' curves.
  """
  case: str
  key: str
  variant: str
  metric: str
  steps: list[int | None]
  final: list[float]
  bytes_per_step: float
  fraction: float = 0.95
  on: str = "metric"
  seeds: list[int] | None = None
  target: float | None = None
  steps_ratio: float | None = None
  steps_ratio_best: float | None = None
  bytes_to_target: float | None = None
  bytes_ratio: float | None = None
  curves: list[Curve] = dataclasses.field(default_factory=list)

  @property
  def mean_steps(self) -> float | None:
    """The steps to the target over the seeds; None if any seed never got there."""
    reached = [s for s in self.steps if s is not None]
    return float(np.mean(reached)) if reached and len(reached) == len(self.steps) else None

  @property
  def seed_steps(self) -> str:
    """Each seed's steps to the target as a table shows them (``"never"`` where it never
    got there)."""
    return ", ".join("never" if s is None else str(s) for s in self.steps)

  @property
  def mean_final(self) -> float:
    return float(np.mean(self.final))

  @property
  def falls(self) -> bool:
    """Whether the target's quantity falls as a run improves: the loss, or regression's
    MAE."""
    return self.on == "loss" or self.metric == "mae"

  def to_json(self) -> dict:
    """The row as a ``results.json`` holds it (the mean steps too, for a reader's eyes)."""
    return {**dataclasses.asdict(self), "mean_steps": self.mean_steps}

  @classmethod
  def from_json(cls: type[R], row: dict) -> R:
    """A row :meth:`to_json` wrote (what it derives, such as the mean steps, left out), or
    one written before the rows were typed (:meth:`_upgrade`)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in cls._upgrade(row).items() if k in fields})

  @staticmethod
  def _upgrade(row: dict) -> dict:
    return row


@dataclasses.dataclass
class RowAtP(Row):
  """A :class:`Row` of ``python -m train`` runs on ``p`` devices (its ``case`` is
  ``"P = p"``, its key and label the run's label), with the method and options the
  projection needs."""
  p: int = 0
  method: str = ""
  options: dict = dataclasses.field(default_factory=dict)

  @staticmethod
  def _upgrade(row: dict) -> dict:
    """A row written before the rows were typed has a ``label``: the key and the variant;
    its metric is accuracy."""
    if "label" not in row:
      return row
    return {"case": f"P = {row['p']}", "key": row["label"], "variant": row["label"],
            "metric": "accuracy", **row}


# One experiment's training runs in one file: what python -m train wrote under its folder,
# each run's metrics.json by the run's folder (relative, "/"-separated) and each log its job
# wrote by its path (:func:`bundle`).
BUNDLE = "runs.json"


def bundle(folder: str) -> int:
  """Folds every ``python -m train`` run under ``folder`` into ``folder/runs.json`` (each
  ``metrics.json`` by its run's folder, each ``.log`` by its path, beside any runs the file
  holds already) and removes what it folded: the files, what the trainer wrote beside each
  ``metrics.json`` that it renders again (its ``results.md``, ``metrics.csv`` and plot) and
  the folders left empty.

  It is atomic and can run again: every run folder's writer lock is taken for the whole
  fold (a run a live trainer writes is refused), every file is read and checked before
  anything is written or removed (each bad file named), the bundle is written whole before
  any file goes, and a run found both in the bundle and on disk with the same content is
  the same run (a fold interrupted after the bundle was written finishes on the next call).

  Returns the runs folded; a ValueError naming every file that cannot be folded (unreadable,
  not a trainer's record, another run of a folder the bundle holds) or a run being written.
  """
  path = os.path.join(folder, BUNDLE)
  held = _load(path) if os.path.exists(path) else {"runs": {}, "logs": {}}
  metrics = sorted(glob.glob(os.path.join(folder, "**", "metrics.json"), recursive=True))
  logs = sorted(glob.glob(os.path.join(folder, "**", "*.log"), recursive=True))
  with contextlib.ExitStack() as locks:
    for file in metrics:  # no trainer may write a run while it is folded
      if not os.path.exists(os.path.join(os.path.dirname(file), lock.LOCK)):
        continue  # no trainer ever wrote here (a trainer makes the file as it starts)
      try:
        locks.enter_context(lock.writer(os.path.dirname(file)))
      except lock.Busy as error:
        raise ValueError(f"bundle: {os.path.dirname(file)} is a run being written: "
                         f"{error}") from None
    found, bad = {"runs": {}, "logs": {}}, []
    for file, kind in [(f, "runs") for f in metrics] + [(f, "logs") for f in logs]:
      key = _key(folder, os.path.dirname(file) if kind == "runs" else file)
      try:
        content = _checked_run(file) if kind == "runs" else _text(file)
      except ValueError as error:
        bad.append(f"{file}: {error}")
        continue
      if key in held[kind] and held[kind][key] != content:
        bad.append(f"{file}: {folder}'s {BUNDLE} holds {key!r} already, and this is another "
                   f"run of it")
      found[kind][key] = content
    if bad:
      raise ValueError("bundle: nothing written or removed; " + "; ".join(bad))
    for kind in ("runs", "logs"):
      held[kind].update(found[kind])
    with open(path + ".tmp", "w") as f:
      json.dump(held, f, indent=1)
    os.replace(path + ".tmp", path)
    for key, record in held["runs"].items():  # the bundle holds them: what is left goes
      for name in (*report.files(record["runs"][0]["metric"]), lock.LOCK):
        if os.path.exists(gone := os.path.join(folder, key, name)):
          os.remove(gone)
    for file in logs:
      os.remove(file)
  for here, _, _ in sorted(os.walk(folder), reverse=True):  # the deepest first
    if here != folder and not os.listdir(here):
      os.rmdir(here)
  return len(metrics)


def _checked_run(file: str) -> dict:
  """A ``metrics.json``'s content, checked to be a trainer's record of at least one run."""
  try:
    with open(file, encoding="utf-8") as f:
      saved = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
    raise ValueError(f"cannot be read as JSON ({error})") from None
  runs_ = saved.get("runs") if isinstance(saved, dict) else None
  if not (isinstance(runs_, list) and runs_ and all(isinstance(r, dict) and "metric" in r
                                                     for r in runs_)
          and isinstance(saved.get("config"), dict)):
    raise ValueError("is no python -m train record of a run (no config, or no runs with "
                     "their metric)")
  return saved


def _text(file: str) -> str:
  try:
    with open(file, encoding="utf-8") as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as error:
    raise ValueError(f"cannot be read as UTF-8 text ({error})") from None


def _key(folder: str, path: str) -> str:
  return os.path.relpath(path, folder).replace(os.sep, "/")


def _load(path: str) -> dict:
  try:
    with open(path) as f:
      held = json.load(f)
  except (OSError, json.JSONDecodeError) as error:
    raise ValueError(f"{path} cannot be read as a bundle of runs: {error}") from None
  if not (isinstance(held, dict) and isinstance(held.get("runs"), dict)):
    raise ValueError(f"{path} is not a bundle of runs (benchmarks.runs.bundle writes them)")
  held.setdefault("logs", {})
  return held


def _above(folder: str):
  """``folder`` (absolute) and every folder above it, the nearest first."""
  folder = os.path.abspath(folder)
  while True:
    yield folder
    if os.path.dirname(folder) == folder:
      return
    folder = os.path.dirname(folder)


def lookup(path: str) -> list[RunRecord] | None:
  """The runs of the ``metrics.json`` at ``path``, a file or kept in a bundle of a folder
  at or above its run's (:func:`bundle`); None when neither holds it."""
  if os.path.exists(path):
    return report.read(path)
  run = os.path.dirname(os.path.abspath(path))
  for folder in _above(run):
    if os.path.exists(bundle_path := os.path.join(folder, BUNDLE)):
      held = _load(bundle_path)["runs"].get(_key(folder, run))
      if held is not None:
        return report.parse(held, f"{path} (in {bundle_path})")
  return None


def read(path: str) -> list[RunRecord]:
  """:func:`lookup`, or the ValueError naming ``path`` when nothing holds it."""
  found = lookup(path)
  return report.read(path) if found is None else found


def find(folders: Sequence[str]) -> list[RunRecord]:
  """Every run of every ``metrics.json`` under ``folders`` (searched recursively; a run kept
  in a bundle counts where its file was), in path order; a ValueError when there is none."""
  found = []
  for folder in folders:
    for path in glob.glob(os.path.join(folder, "**", "metrics.json"), recursive=True):
      found.append((os.path.abspath(path), report.read(path)))
    bundles = glob.glob(os.path.join(folder, "**", BUNDLE), recursive=True) + [
        path for above in list(_above(folder))[1:]  # a bundle of a folder above holds it
        if os.path.exists(path := os.path.join(above, BUNDLE))]
    for path in bundles:
      base = os.path.dirname(os.path.abspath(path))
      for key, saved in _load(path)["runs"].items():
        run = os.path.join(base, key)
        if os.path.commonpath([run, os.path.abspath(folder)]) == os.path.abspath(folder):
          found.append((os.path.join(run, "metrics.json"),
                        report.parse(saved, f"{path}: {key}")))
  if not found:
    raise ValueError(f"no metrics.json under {', '.join(folders)}")
  return [run for _, records in sorted(found, key=lambda pair: pair[0]) for run in records]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.runs",
      description="Fold each experiment's python -m train runs into one file: every "
                  "metrics.json and .log under FOLDER into FOLDER/runs.json, which the "
                  "drivers read as they read the files.")
  parser.add_argument("--bundle", required=True, metavar="FOLDER[,FOLDER...]")
  args = parser.parse_args(argv)
  folders = args.bundle.split(",")
  missing = [f for f in folders if not os.path.isdir(f)]
  if missing:
    parser.error(f"--bundle: not a folder: {', '.join(missing)}")
  for folder in folders:
    try:
      print(f"{folder}: {bundle(folder)} runs folded into {BUNDLE}")
    except ValueError as error:
      print(f"python -m benchmarks.runs: error: {error}", file=sys.stderr)
      return 2
  return 0


def target(dense_finals: Sequence[float], fraction: float) -> float:
  """``fraction`` of dense's final metric, the mean over its runs (seeds)."""
  return fraction * float(np.mean(dense_finals))


def first_reaching(points: Sequence[Point], goal: float,
                   metric: Callable[[Any], float] = lambda point: point[-1]) -> Point | None:
  """The first of ``points`` (a run's evaluations, in order) whose ``metric`` (by default
  its last field) is at least ``goal``, or None if none is: the metric is one that grows
  (accuracy)."""
  return next((point for point in points if metric(point) >= goal), None)


def write_rows(out: str, meta: dict, rows: list[dict], table: str) -> None:
  """A driver's raw output under ``out``: ``results.json`` (``meta`` and the ``rows``) and
  ``results.md`` (their ``table``), each replaced whole (a run killed while writing leaves
  the previous pair)."""
  os.makedirs(out, exist_ok=True)
  for name, text in (("results.json", json.dumps({**meta, "rows": rows}, indent=2)),
                     ("results.md", table + "\n")):
    path = os.path.join(out, name)
    with open(path + ".tmp", "w") as f:
      f.write(text)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
  sys.exit(main())
