"""The train loop's bookkeeping: where a run is (:class:`Position`, what a checkpoint records
to resume it), and :class:`Loop`, which compiles the step once, dispatches steps without
fetching anything, fetches the metrics of a log interval at once, times the steps and shows
progress."""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import jax
import numpy as np
import spardl_jax as sj
from spardl_jax.tools.progress import bar, shown

__all__ = ['host', 'Position', 'Loop']

log = logging.getLogger("train")


def host(x) -> np.ndarray:
  """This process's first copy/row of ``x`` (whole arrays may span processes)."""
  return np.asarray(x.addressable_data(0))



class Position(NamedTuple):
  """Where a run is: ``done`` steps of ``epoch`` taken, their metric ``rows`` (loss,
  metric, bytes) and the Grain iterator's state after them (None at an epoch's start)."""

  epoch: int
  done: int
  rows: list
  iterator: dict | None

  @classmethod
  def start(cls, epoch: int) -> "Position":
    """The start of ``epoch``: nothing taken yet."""
    return cls(epoch, 0, [], None)


class Loop:
  """The train loop's bookkeeping: compile once (reported on its own line), dispatch steps
  without fetching anything (at most a few ahead on simulated CPU devices, see
  :func:`spardl_jax.bounded_dispatch`), and fetch the metrics of a whole log interval at once.

  Step times: a log interval's wall time is spread over its steps (dispatch runs ahead, so
  timing each call would only measure the dispatch); evaluations and checkpoint saves
  between intervals are left out.

  Progress: a bar of the steps on a terminal (:mod:`spardl_jax.tools.progress`; ``nested``
  under a sweep's bar of runs), advanced at each fetch; off a terminal only the compile and
  epoch lines.
  """

  def __init__(self, label: str, *, total: int, log_every: int, progress: bool,
               nested: bool = False):
    self.label, self.total, self.log_every = label, total, log_every
    self.logging = jax.process_index() == 0  # one process logs
    self.shown = shown(progress and self.logging)
    self.nested = nested
    self.step_fn, self.bar = None, None
    self.pending, self.epoch_rows, self.times = [], [], []
    self.interval_start, self.done = None, 0
    self.compile_seconds = 0.0

  def compile(self, train, state, batch) -> None:
    start = time.perf_counter()
    self.step_fn = sj.bounded_dispatch(train.lower(state, batch).compile())
    self.compile_seconds = time.perf_counter() - start
    self.log(f"train step compiled in {self.compile_seconds:.1f} s")
    if self.shown:  # after the compile, so the bar's rate and time left are real
      self.bar = bar(total=self.total, desc=self.label, nested=self.nested)
    self.interval_start = time.perf_counter()

  def step(self, state, batch, epoch: int):
    state, metrics = self.step_fn(state, batch)
    self.pending.append(metrics)
    if len(self.pending) >= self.log_every:
      self._drain(epoch)
    return state

  def _drain(self, epoch: int) -> None:
    if not self.pending:
      return
    # Bytes: the first device's (the most any device sends, for gTopk's root).
    rows = np.array([[host(m.loss), host(m.metric), host(m.bytes_sent)[0]]
                     for m in self.pending], np.float64)
    now = time.perf_counter()
    self.times += [(now - self.interval_start) / len(rows)] * len(rows)
    self.interval_start = now
    self.epoch_rows.append(rows)
    self.done += len(rows)
    self.pending = []
    if self.bar is not None:
      self.bar.update(len(rows))
      self.bar.set_postfix(epoch=epoch, loss=f"{rows[-1, 0]:.3f}")

  def start_epoch(self, rows: list) -> None:
    """Starts an epoch's metrics, with the rows of steps a checkpoint already took."""
    self.epoch_rows = [np.asarray(rows, np.float64).reshape(-1, 3)]
    self.restart_clock()  # the evaluation since the last fetch is not a step's time

  def restart_clock(self) -> None:
    """The next log interval's time starts now (after work that is not a train step)."""
    self.interval_start = time.perf_counter()

  def rows_so_far(self, epoch: int) -> np.ndarray:
    """This epoch's ``(steps, 3)`` metrics (loss, metric, bytes) up to now, fetched now."""
    self._drain(epoch)
    return np.concatenate(self.epoch_rows)

  def fetch(self, epoch: int) -> np.ndarray:
    """This epoch's ``(steps, 3)`` metrics, fetched now; the next epoch starts empty."""
    self._drain(epoch)
    rows, self.epoch_rows = np.concatenate(self.epoch_rows), []
    return rows

  def log(self, message: str) -> None:
    """A line of the run's record (the compile, each epoch), also with progress off."""
    if not self.logging:
      return
    if self.bar is not None:
      self.bar.write(f"{self.label}: {message}")
    else:
      log.info("%s: %s", self.label, message)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
