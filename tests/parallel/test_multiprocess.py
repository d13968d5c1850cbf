"""Several local processes (jax.distributed + gloo) give the same bits as one process with
simulated devices; a dead rank stops the job. Hard timeouts everywhere: nothing may hang."""

import glob
import io
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import spardl_jax as sj
from spardl_jax import launch
from tests import harness
from tests.parallel import mp_worker

WORKER = os.path.join(os.path.dirname(__file__), "mp_worker.py")


def run_job(mode, tmp_path, processes=2, devices=2, timeout=240):
  out = io.StringIO()
  code = launch.launch([sys.executable, WORKER, mode, str(tmp_path)], processes=processes,
                       devices_per_process=devices, timeout=timeout, out=out)
  return code, out.getvalue()


def load(tmp_path):
  saved = {}
  for path in sorted(glob.glob(str(tmp_path / "rank*.npz"))):
    saved.update(dict(np.load(path)))
  return saved


# The tests that read the `job` fixture run in one xdist worker (--dist loadgroup), so the
# 2-process job runs once, not once in each worker (about 15 s).
JOB = pytest.mark.xdist_group("multiprocess_job")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
  """One 2-process job runs both the all-reduce and the training modes."""
  out = tmp_path_factory.mktemp("job")
  code, log = run_job("allreduce,train", out)
  assert code == 0, log
  return load(out)


@JOB
def test_allreduce_over_processes_is_bit_identical_to_simulated_devices(job):
  saved = job
  p = 4
  xs = mp_worker.inputs(p, mp_worker.N)
  for name, options in mp_worker.CASES.items():
    method = sj.methods.make(name.split("_")[0], **options)
    ys, state = harness.compiled_method(p, method)(harness.put(p, xs),
                                                   harness.method_rows(p, mp_worker.N, method))
    for row in range(p):
      np.testing.assert_array_equal(saved[f"{name}_y_{row}"], np.asarray(ys)[row])
      np.testing.assert_array_equal(saved[f"{name}_r_{row}"], np.asarray(state.residual)[row])


@JOB
def test_training_over_processes_matches_one_process(job):
  saved = job
  from train import data
  from train.config import TrainConfig, Variant
  from train import make_mesh, train_and_evaluate
  cfg = TrainConfig(model="mlp", model_size="tiny", dataset="digits", devices=4, epochs=2,
                    batch_size=64)
  ds, reads = mp_worker.recording(data.load("digits"))
  result = train_and_evaluate(cfg, Variant("spardl", "spardl", {"density": 0.05}), ds,
                              make_mesh(4), progress=False)
  # Each process read only its half of every global batch: rank 0 the first 32 rows (its
  # devices come first on the mesh), rank 1 the rest.
  batches = np.stack(reads[1:])  # reads[0]: the one example the model is initialized from
  assert batches.shape == (2 * (len(ds.train) // 64), 64)
  np.testing.assert_array_equal(saved["reads_0"], batches[:, :32])
  np.testing.assert_array_equal(saved["reads_1"], batches[:, 32:])
  for i, leaf in enumerate(jax.tree.leaves(result.state.params)):
    np.testing.assert_array_equal(saved[f"param_{i}"], np.asarray(leaf))
  residual = np.asarray(result.state.opt_state[0].method_state.residual)
  for row in range(4):
    np.testing.assert_array_equal(saved[f"r_{row}"], residual[row])


KILLER = os.path.join(os.path.dirname(__file__), "kill_worker.py")
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@JOB
def test_a_rank_killed_mid_epoch_resumes_bit_identically(job, tmp_path, monkeypatch):
  """`launch --processes 2 -- python -m train --checkpoint --checkpoint-every 10` with rank 1
  SIGKILLed at step 15 of epoch 2 (22 steps an epoch): the launcher stops the job; the same
  command again resumes from the checkpoint of step 30, step 8 of epoch 2 (the Grain
  iterator and the epoch's metrics so far included) and ends with the parameters and residuals of an
  uninterrupted run (the `job` fixture's, itself equal to one process with 4 devices)."""
  monkeypatch.setenv("PYTHONPATH", REPO)  # `python -m train` runs from the repository
  flags = ["--model", "mlp", "--model-size", "tiny", "--dataset", "digits", "--epochs", "2",
           "--batch-size", "64", "--method", "spardl", "--density", "0.05", "--checkpoint",
           "--checkpoint-every", "10", "--no-progress", "--out", str(tmp_path)]
  train = ["python", "-m", "train", *flags]
  out = io.StringIO()
  code = launch.launch([sys.executable, KILLER, "2", "15", "--", *train], processes=2,
                       devices_per_process=2, timeout=240, out=out)
  assert code != 0 and "rank 1 exited with -9" in out.getvalue(), out.getvalue()
  ckpt = tmp_path / "checkpoints" / "spardl"
  # Numbered by steps taken: every 10th and each epoch's end (22); the newest two are kept.
  assert sorted(os.listdir(ckpt), key=int) == ["22", "30"]
  out = io.StringIO()
  code = launch.launch([sys.executable, "-m", "train", *flags], processes=2,
                       devices_per_process=2, timeout=240, out=out)
  assert code == 0 and "at epoch 2, step 8 of 22" in out.getvalue(), out.getvalue()

  from models import create
  from train import checkpoint, data
  from train.config import TrainConfig, Variant
  from train import create_train_state, make_mesh, make_optimizer
  cfg = TrainConfig(model="mlp", model_size="tiny", dataset="digits", epochs=2, batch_size=64)
  ds = data.load("digits")
  tx = make_optimizer(cfg, Variant("spardl", "spardl", {"density": 0.05}))
  like, _ = create_train_state(jax.random.key(0), create(cfg.model, cfg.model_size, **ds.info),
                               tx, ds.train.take(np.arange(1))[0], make_mesh(4), "data")
  mgr = checkpoint.manager(str(ckpt))
  step, state, _ = checkpoint.restore_latest(mgr, like)
  mgr.close()
  assert step == 44
  for i, leaf in enumerate(jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(job[f"param_{i}"], np.asarray(leaf))
  residual = np.asarray(state.opt_state[0].method_state.residual)
  for row in range(4):
    np.testing.assert_array_equal(job[f"r_{row}"], residual[row])


def test_a_dead_rank_stops_the_job_quickly(tmp_path):
  start = time.monotonic()
  code, log = run_job("crash", tmp_path, timeout=60)
  assert code != 0
  assert time.monotonic() - start < 45, log
  assert "rank 1 exited with 3" in log


def test_launcher_timeout_and_usage(capsys):
  out = io.StringIO()
  start = time.monotonic()
  code = launch.launch([sys.executable, "-c", "import time; time.sleep(60)"], processes=2,
                       timeout=2, out=out)
  assert code == 124 and time.monotonic() - start < 15
  assert launch.main(["--processes", "2"]) == 2
  for bad in ("nan", "-1", "0", "inf"):  # no timeout at all, or every rank killed at once
    with pytest.raises(SystemExit):
      launch.main(["--processes", "1", "--timeout", bad, "--", "true"])
    assert f"--timeout must be a positive, finite number of seconds, got {bad}" in (
        capsys.readouterr().err)
  with pytest.raises(ValueError, match="timeout must be a positive, finite"):
    launch.launch(["true"], processes=1, timeout=float("nan"))


@pytest.mark.parametrize("processes,local", [(1, 4), (2, 2)])
def test_host_teams(processes, local):
  class Device:
    def __init__(self, process_index):
      self.process_index = process_index
  devices = [Device(p) for p in range(processes) for _ in range(local)]
  assert sj.distributed.host_teams(devices) == processes
  with pytest.raises(ValueError, match="process order"):
    sj.distributed.host_teams(devices[::-1] if processes > 1 else [Device(1), Device(0)])


def test_a_terminated_launcher_stops_its_ranks(tmp_path):
  """SIGTERM to the launcher (a scheduler's stop, `kill`): its ranks, in their own sessions
  (a signal to the launcher never reaches them), die with it. Ranks deaf to SIGTERM, as our
  jax.distributed ranks were, get SIGKILL 5 s later (`launch._stop`); that wait is left out
  here to spare the suite's time."""
  pids = tmp_path / "pids"
  rank = (f"import os, time; open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n'); "
          "time.sleep(120)")
  job = subprocess.Popen([sys.executable, "-m", "spardl_jax.launch", "--processes",
                          "2", "--", sys.executable, "-c", rank], stdout=subprocess.PIPE,
                         text=True)
  deadline = time.monotonic() + 30
  while (not pids.exists() or len(pids.read_text().split()) < 2) and time.monotonic() < deadline:
    time.sleep(0.1)
  job.terminate()
  out, _ = job.communicate(timeout=30)
  assert job.returncode == 143 and "terminated; stopping every rank" in out
  for pid in map(int, pids.read_text().split()):
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)
