"""Checkpoints that survive crashes: unreadable checkpoints are skipped for the newest good
one, a writer killed mid-save leaves no half checkpoint, and a checkpoint of another state
is a clear error naming the leaf and both shapes."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spardl_jax.parallel import launch
from train import checkpoint
from train.train import make_mesh

REPO = os.path.join(os.path.dirname(__file__), "..", "..")


def make_state(value, rows=(3, 4), devices=2, n=6):
  """A small train-state-like tree: replicated params, a per-device residual."""
  mesh = make_mesh(devices)
  params = jax.device_put(jnp.full(rows, value, jnp.float32), NamedSharding(mesh, P()))
  residual = jax.device_put(jnp.full((devices, n), value, jnp.float32),
                            NamedSharding(mesh, P("data")))
  return {"params": params, "opt": {"residual": residual}}


def write(directory, steps, **shape):
  mgr = checkpoint.manager(directory, max_to_keep=3)
  for step in steps:
    checkpoint.save(mgr, step, make_state(float(step), **shape), [{"epoch": step}])
  mgr.close()


def restore(directory, **shape):
  mgr = checkpoint.manager(directory)
  try:
    return checkpoint.restore_latest(mgr, make_state(0.0, **shape))
  finally:
    mgr.close()


def test_a_junk_step_folder_is_skipped_for_the_newest_good_checkpoint(tmp_path, caplog):
  write(tmp_path, [1, 2])
  junk = tmp_path / "3"
  junk.mkdir()
  (junk / "state").write_text("not a checkpoint")
  step, state, history = restore(tmp_path)
  assert step == 2 and history == [{"epoch": 2}]
  np.testing.assert_array_equal(np.asarray(state["params"]), 2.0)
  assert "checkpoint 3" in caplog.text and "skipped" in caplog.text


def test_a_corrupted_file_is_skipped_for_the_older_checkpoint(tmp_path, caplog):
  write(tmp_path, [1, 2])
  files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "2" / "state") for f in fs
           if os.path.basename(d) == "d"]  # the array data files
  assert files
  for path in files:  # every data file of the newest checkpoint
    with open(path, "r+b") as f:
      f.write(b"\xff" * os.path.getsize(path))
  step, state, _ = restore(tmp_path)
  assert step == 1
  np.testing.assert_array_equal(np.asarray(state["opt"]["residual"]), 1.0)
  assert "checkpoint 2" in caplog.text and "skipped" in caplog.text


def test_another_train_state_names_the_leaves_on_one_side_only(tmp_path):
  write(tmp_path, [1])
  mgr = checkpoint.manager(tmp_path)
  like = make_state(0.0)
  like["opt"] = {"residual": like["opt"]["residual"], "velocity": like["opt"]["residual"]}
  with pytest.raises(checkpoint.CheckpointMismatch,
                     match=r"holds another train state .*opt/velocity"):
    checkpoint.restore_latest(mgr, like)
  mgr.close()


def test_another_shape_names_the_leaf_and_both_shapes(tmp_path):
  write(tmp_path, [1], rows=(5, 4))
  with pytest.raises(checkpoint.CheckpointMismatch,
                     match=r"leaf params has shape \(5, 4\) there and \(3, 4\) here"):
    restore(tmp_path, rows=(3, 4))
  # The per-device leaves may differ in their device count (restore onto other devices).
  step, state, _ = restore(tmp_path, rows=(5, 4), devices=4)
  assert step == 1
  np.testing.assert_allclose(np.asarray(state["opt"]["residual"]).sum(0), 2.0)


def test_a_writer_killed_mid_save_leaves_only_whole_checkpoints(tmp_path):
  """SIGKILL a process that keeps saving 8 MB checkpoints: what is left restores cleanly
  and holds exactly the values of its step."""
  script = textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {REPO!r})
      import jax
      jax.config.update("jax_num_cpu_devices", 2)
      from tests.trainer.test_checkpoint import make_state
      from train import checkpoint
      mgr = checkpoint.manager({str(tmp_path)!r}, max_to_keep=3)
      for step in range(1, 1000):
        checkpoint.save(mgr, step, make_state(float(step), rows=(1024, 2048)), [])
        print(step, flush=True)
      """)
  proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                          env=launch.child_environment(),
                          start_new_session=True, text=True)
  try:
    assert proc.stdout.readline().strip() == "1"  # a first checkpoint is complete
    time.sleep(np.random.default_rng().uniform(0.2, 1.5))  # then die anywhere in a save
  finally:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
  step, state, _ = restore(tmp_path, rows=(1024, 2048))
  assert step >= 1
  np.testing.assert_array_equal(np.asarray(state["params"]), float(step))
  np.testing.assert_array_equal(np.asarray(state["opt"]["residual"]), float(step))
