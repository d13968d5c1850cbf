"""``python tests/parallel/kill_worker.py EPOCH STEP -- python -m train ARGS``: runs the
trainer in this process, and rank 1 of the job kills itself with SIGKILL when it has taken
STEP steps of epoch EPOCH (a crash at a known point in the middle of an epoch)."""

import os
import runpy
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository

from train import input_pipeline  # noqa: E402

EPOCH, STEP = int(sys.argv[1]), int(sys.argv[2])
_batches = input_pipeline.train_batches


class BatchesThenDie:
  """The trainer's batch iterator (Grain's, checkpointable), but rank 1 dies at STEP of
  EPOCH: before handing out that batch, STEP batches into the epoch."""

  def __init__(self, *args, epoch, **kwargs):
    self.batches = _batches(*args, epoch=epoch, **kwargs)
    self.epoch, self.taken = epoch, 0

  def __iter__(self):
    return self

  def __next__(self):
    if (self.epoch, self.taken) == (EPOCH, STEP) and os.environ.get("SPARDL_PROCESS_ID") == "1":
      os.kill(os.getpid(), signal.SIGKILL)
    self.taken += 1
    return next(self.batches)

  def get_state(self):
    return self.batches.get_state()


input_pipeline.train_batches = BatchesThenDie
sys.argv = ["train"] + sys.argv[sys.argv.index("--") + 4:]  # after "-- python -m train"
runpy.run_module("train", run_name="__main__")
