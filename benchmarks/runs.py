"""What the benchmarks read of training runs, and when a run reaches a target.

Every driver reads ``python -m train`` runs through :func:`train.report.read` (the one place
``metrics.json`` is written and read) and measures "steps (or seconds) to a fraction of
dense's final metric" with :func:`target` and :func:`first_reaching`.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from spardl_jax.tools.provenance import provenance
from train import report
from train.report import RunRecord

__all__ = ['RunRecord', 'find', 'target', 'first_reaching', 'provenance', 'write_rows']

Point = TypeVar("Point")


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
