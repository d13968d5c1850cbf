"""Metrics files, the plot and the final table of a training run.

``metrics.json`` is the run's record: the run's configuration and one :class:`RunRecord` per
variant. It is written by :func:`write` and read back by :func:`read` (the benchmarks read
runs only through it).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from typing import Any

from train.train import RunResult


@dataclasses.dataclass(frozen=True)
class RunRecord:
  """One variant's run as ``metrics.json`` keeps it.

  Attributes:
    label: the variant's spec, e.g. ``'spardl:density=0.05'`` (its key in ``--compare``).
    method: the registered method it synced with.
    options: the method's options.
    metric: ``'accuracy'`` or ``'mae'``.
    history: one dict per evaluation (:class:`train.train.RunResult`'s ``history``).
    seed: the run's ``--seed``.
    devices: the devices of the data axis it trained on.
    num_params: parameters synchronized per step.
    bytes_per_step: bytes each device sent per step, the mean over the run.
    time_per_step: median wall seconds of a train step.
  """

  label: str
  method: str
  options: dict
  metric: str
  history: list
  seed: int
  devices: int
  num_params: int = 0
  bytes_per_step: float = 0.0
  time_per_step: float = 0.0

  def curve(self, x: str = "steps") -> list[tuple[Any, float]]:
    """``(history[x], test metric)`` at each evaluation, e.g. ``x='train_seconds'``."""
    return [(h[x], h[f"test_{self.metric}"]) for h in self.history]

  @property
  def final(self) -> float:
    """The test metric at the last evaluation."""
    return self.history[-1][f"test_{self.metric}"]


def _from_json(run: dict, config: dict) -> RunRecord:
  """One entry of ``metrics.json``'s ``runs`` (its ``method`` key holds the label, as the
  files always have) with what the file's config says of it."""
  variant = next(v for v in config["variants"] if v["label"] == run["method"])
  return RunRecord(label=run["method"], method=variant["method"], options=variant["options"],
                   metric=run["metric"], history=run["history"], seed=int(config["seed"]),
                   devices=int(config["devices"]), num_params=run["num_params"],
                   bytes_per_step=run["bytes_per_step"], time_per_step=run["time_per_step"])


def read(path: str) -> list[RunRecord]:
  """The runs of a ``metrics.json`` written by :func:`write`; a ValueError naming ``path``
  when it is missing or holds something else."""
  try:
    with open(path) as f:
      saved = json.load(f)
  except FileNotFoundError:
    raise ValueError(f"no {path} (a folder python -m train wrote with --out)") from None
  except (OSError, json.JSONDecodeError) as error:
    raise ValueError(f"{path} is not a python -m train metrics.json ({type(error).__name__}: "
                     f"{error})") from None
  return parse(saved, path)


def parse(saved: Any, path: str) -> list[RunRecord]:
  """The runs of a ``metrics.json``'s content ``saved`` (read from ``path``, which the
  ValueError names when it holds something else)."""
  try:
    return [_from_json(run, saved["config"]) for run in saved["runs"]]
  except (KeyError, TypeError, StopIteration) as error:
    raise ValueError(f"{path} is not a python -m train metrics.json ({type(error).__name__}: "
                     f"{error})") from None


def _summary(run: dict) -> tuple[str, float, float, float, float, float]:
  """One run of ``metrics.json``'s ``runs``: its label, final and best test metric, final
  test loss, bytes sent per step and device, and milliseconds per step."""
  values = [h[f"test_{run['metric']}"] for h in run["history"]]
  best = min(values) if run["metric"] == "mae" else max(values)
  return (run["method"], values[-1], best, run["history"][-1]["test_loss"],
          run["bytes_per_step"], run["time_per_step"] * 1e3)


def format_table(runs: list[dict]) -> str:
  """Method, final/best test metric, test loss, bytes sent per step and device, time per
  step, of ``metrics.json``'s ``runs``, as the trainer prints them: each column as wide as
  its widest cell or header, two spaces apart, the method's aligned left and the numbers'
  right, so every header stands over its own column whatever the labels' lengths."""
  metric = runs[0]["metric"]
  header = ["method", f"test {metric}", f"best {metric}", "test loss", "bytes/step", "ms/step"]
  rows = [[label, f"{final:.4f}", f"{best:.4f}", f"{loss:.4f}", f"{sent:,.0f}", f"{ms:.1f}"]
          for label, final, best, loss, sent, ms in map(_summary, runs)]
  widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
  return "\n".join("  ".join([row[0].ljust(widths[0])]
                             + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])])
                   for row in [header, *rows])


def format_markdown(runs: list[dict]) -> str:
  """:func:`format_table` as a Markdown table (which a page can copy and a test re-render
  from ``metrics.json``)."""
  lines = [f"| method | test {runs[0]['metric']} | best | test loss | bytes/step | ms/step |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
  lines += [f"| {label} | {final:.4f} | {best:.4f} | {loss:.4f} | {sent:,.0f} | {ms:.1f} |"
            for label, final, best, loss, sent, ms in map(_summary, runs)]
  return "\n".join(lines) + "\n"


def runs_of(results: list[RunResult]) -> list[dict]:
  """The runs as ``metrics.json`` keeps them: the fields of :class:`RunRecord` that the
  config does not hold (:func:`_from_json` reads them back), and the tuning each trained
  with (the recipe's included: what ``--recipe`` applied)."""
  return [{"method": r.variant, "metric": r.metric, "num_params": r.num_params,
           "bytes_per_step": r.bytes_per_step, "time_per_step": r.time_per_step,
           "history": r.history, **({"tuning": r.tuning} if r.tuning is not None else {})}
          for r in results]


def files(metric: str) -> tuple[str, str, str, str]:
  """The names :func:`write` gives its files for runs of ``metric``: ``metrics.json`` (the
  record), then what it renders from the same data (the curves, the plot, the table)."""
  return ("metrics.json", "metrics.csv", f"{metric}.png", "results.md")


def write(out: str, results: list[RunResult], config: dict) -> list[str]:
  """Writes ``metrics.json``, ``metrics.csv``, ``results.md`` (:func:`format_markdown`) and
  the plot ``<metric>.png`` under ``out`` (:func:`files`)."""
  os.makedirs(out, exist_ok=True)
  runs = runs_of(results)
  paths = [os.path.join(out, name) for name in files(results[0].metric)]
  with open(paths[0], "w") as f:
    json.dump({"config": config, "runs": runs}, f, indent=2)
  with open(paths[1], "w", newline="") as f:
    writer = csv.writer(f)
    keys = list(results[0].history[0])
    writer.writerow(["method", *keys])
    for r in results:
      for h in r.history:
        writer.writerow([r.variant, *(h[k] for k in keys)])
  with open(paths[3], "w") as f:
    f.write(format_markdown(runs))
  _plot(paths[2], results)
  return paths


def _plot(path: str, results: list[RunResult]) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (by_epoch, by_bytes) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
  for r in results:
    epochs = [h["epoch"] for h in r.history]
    acc = [h[f"test_{r.metric}"] for h in r.history]
    sent = [h["bytes_sent"] / 2**20 for h in r.history]
    by_epoch.plot(epochs, acc, marker=".", label=r.variant)
    by_bytes.plot(sent, acc, marker=".", label=r.variant)
  metric = results[0].metric
  by_epoch.set(xlabel="epoch", ylabel=f"test {metric}", title=f"{metric} vs epoch")
  by_bytes.set(xlabel="MiB sent per device (log)", xscale="log",
               title=f"{metric} vs communication")
  by_epoch.legend()
  by_epoch.grid(alpha=0.3)
  by_bytes.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
