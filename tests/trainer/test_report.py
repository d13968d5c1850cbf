"""What the trainer shows: its terminal table lined up under its headers, and a progress bar
drawn on a terminal only (steps done of the total, their rate, the time left)."""

import fcntl
import io
import os
import pty
import re
import select
import struct
import sys
import termios

import pytest

from spardl_jax.tools import progress
from train import report


def _run(label, final, best, loss, sent, ms):
  return {"method": label, "metric": "accuracy", "bytes_per_step": sent,
          "time_per_step": ms / 1e3,
          "history": [{"test_accuracy": best, "test_loss": 9.0},
                      {"test_accuracy": final, "test_loss": loss}]}


def test_every_header_stands_over_its_column():
  """Right edges of the number columns (left edge of the method's) agree on every line, for
  labels shorter and far longer than any fixed width (an islands run's spec is 70 wide)."""
  runs = [_run("dense", 0.9712, 0.9713, 0.1034, 1_234_567, 12.3),
          _run("spardl:outer=30:density=0.03:wire=int4:outer_lr=1:outer_momentum=0.5",
               0.41, 0.42, 2.0218, 2017, 426.0)]
  lines = report.format_table(runs).splitlines()
  assert len(lines) == 3
  cells = [[(m.start(), m.end()) for m in re.finditer(r"\S+(?: \S+)*", line)] for line in lines]
  assert all(len(row) == 6 for row in cells), lines
  assert len({row[0][0] for row in cells}) == 1  # the methods, left-aligned
  for column in range(1, 6):
    assert len({row[column][1] for row in cells}) == 1, (column, lines)
  assert re.split(r"\s{2,}", lines[0]) == ["method", "test accuracy", "best accuracy",
                                           "test loss", "bytes/step", "ms/step"]
  assert re.split(r"\s{2,}", lines[2].strip())[1:] == ["0.4100", "0.4200", "2.0218", "2,017",
                                                       "426.0"]


def test_no_bar_off_a_terminal(monkeypatch):
  """A log file gets nothing from a bar: not drawn, not written."""
  err = io.StringIO()
  monkeypatch.setattr(sys, "stderr", err)
  assert not progress.shown()
  with progress.bar(total=5, desc="run") as steps:
    steps.update(5)
  assert list(progress.bar(range(3), desc="run")) == [0, 1, 2]
  assert err.getvalue() == ""


def test_a_bar_on_a_terminal_counts_steps_and_time_left(monkeypatch):
  primary, secondary = pty.openpty()
  fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
  terminal = os.fdopen(secondary, "w")
  monkeypatch.setattr(sys, "stderr", terminal)
  monkeypatch.delenv(progress.ENV, raising=False)
  assert progress.shown()
  with progress.bar(total=40, desc="dense") as steps:
    steps.update(10)
  terminal.flush()
  terminal.close()
  drawn = b""
  while select.select([primary], [], [], 0.2)[0]:
    try:
      chunk = os.read(primary, 65536)
    except OSError:  # the terminal's other end closed
      break
    if not chunk:
      break
    drawn += chunk
  os.close(primary)
  drawn = drawn.decode()
  assert "dense" in drawn and "10/40" in drawn
  assert re.search(r"<\d\d:\d\d", drawn)  # tqdm's time left
  assert not progress.shown(enabled=False)  # --no-progress
  monkeypatch.setenv(progress.ENV, "0")  # every command's
  assert not progress.shown()


def test_every_driver_offers_no_progress(capsys):
  """The drivers with long loops take --no-progress (benchmarks.cli.add_progress)."""
  import importlib
  for name in ("convergence", "time_to_accuracy", "step_time", "sharded_step", "floor_cpu",
               "outer_sync_time", "staleness", "per_rank", "versus"):
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit):
      module.main(["--help"])
    assert "--no-progress" in capsys.readouterr().out, name
