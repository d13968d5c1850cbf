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


def batches_then_die(*args, epoch, **kwargs):
  for step, batch in enumerate(_batches(*args, epoch=epoch, **kwargs)):
    if epoch == EPOCH and step == STEP and os.environ.get("SPARDL_PROCESS_ID") == "1":
      os.kill(os.getpid(), signal.SIGKILL)
    yield batch


input_pipeline.train_batches = batches_then_die
sys.argv = ["train"] + sys.argv[sys.argv.index("--") + 4:]  # after "-- python -m train"
runpy.run_module("train", run_name="__main__")
