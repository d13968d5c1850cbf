"""One writer per run folder: a second trainer on the same --out is refused before it trains
or writes, naming the first; a killed writer leaves nothing that blocks the next one."""

import os
import signal
import subprocess
import sys
import textwrap

from spardl_jax import launch
from train import lock
from train.main import main

REPO = os.path.join(os.path.dirname(__file__), "..", "..")


def _holder(out):
  """A process holding ``out``'s lock until killed; returns once it holds it."""
  code = textwrap.dedent(f"""
      import time
      from train import lock
      with lock.writer({str(out)!r}):
        print("held", flush=True)
        time.sleep(300)
  """)
  proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                          text=True, env=launch.child_environment())
  assert proc.stdout.readline().strip() == "held"
  return proc


def test_a_second_writer_is_refused_naming_the_first_and_a_killed_one_blocks_nothing(
    tmp_path, capsys):
  holder = _holder(tmp_path)
  try:
    code = main(["--out", str(tmp_path), "--epochs", "1", "--steps-per-epoch", "1",
                 "--method", "dense", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"is being written by another run (pid {holder.pid} on " in err
    assert not (tmp_path / "metrics.json").exists()
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  with lock.writer(str(tmp_path)):  # the kernel released the killed holder's lock
    other = subprocess.run(
        [sys.executable, "-c", f"from train import lock\nwith lock.writer({str(tmp_path)!r}):"
                               "\n  pass"],
        cwd=REPO, capture_output=True, text=True, env=launch.child_environment())
  assert other.returncode != 0
  assert f"is being written by another run (pid {os.getpid()} on " in other.stderr
