"""What the benchmarks read of training runs, and when a run reaches a target.

Every driver reads ``python -m train`` runs through :func:`train.report.read` (the one place
``metrics.json`` is written and read) and measures "steps (or seconds) to a fraction of
dense's final metric" with :func:`target` and :func:`first_reaching`.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from spardl_jax.tools.provenance import provenance
from train import report
from train.report import RunRecord

__all__ = ['RunRecord', 'Runs', 'Row', 'RowAtP', 'find', 'target', 'first_reaching', 'provenance',
           'write_rows']

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


def find(folders: Sequence[str]) -> list[RunRecord]:
  """Every run of every ``metrics.json`` under ``folders`` (searched recursively), in path
  order; a ValueError when there is none."""
  paths = sorted(p for folder in folders
                 for p in glob.glob(os.path.join(folder, "**", "metrics.json"), recursive=True))
  if not paths:
    raise ValueError(f"no metrics.json under {', '.join(folders)}")
  return [run for path in paths for run in report.read(path)]


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
