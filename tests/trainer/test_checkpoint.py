"""Checkpoints that survive crashes: unreadable checkpoints are moved aside for the newest
good one and never cost a good one, a writer killed mid-save leaves no half checkpoint, and
a checkpoint of another state is a clear error naming the leaf and both shapes."""

import collections
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

from spardl_jax._src.baselines.common import ResidualState
from spardl_jax import launch
from train import checkpoint
from train import make_mesh

REPO = os.path.join(os.path.dirname(__file__), "..", "..")


def make_state(value, rows=(3, 4), devices=2, n=6):
  """A small train-state-like tree: replicated params, a per-device residual."""
  mesh = make_mesh(devices)
  params = jax.device_put(jnp.full(rows, value, jnp.float32), NamedSharding(mesh, P()))
  residual = jax.device_put(jnp.full((devices, n), value, jnp.float32),
                            NamedSharding(mesh, P("data")))
  return {"params": params, "opt": ResidualState(residual)}  # its type says: fold the sum


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


def _data_files(step_dir):
  return [os.path.join(d, f) for d, _, fs in os.walk(step_dir / "state") for f in fs
          if os.path.basename(d) == "d"]  # the array data files


def _corrupt(step_dir):
  for path in _data_files(step_dir):
    with open(path, "r+b") as f:
      f.write(b"\xff" * os.path.getsize(path))


def _truncate(step_dir):
  for path in _data_files(step_dir):
    os.truncate(path, os.path.getsize(path) // 3)


def _junk_file(step_dir):
  (step_dir / "state" / "manifest.ocdbt").write_bytes(b"junk")


def _junk_step_folder(step_dir):  # a newer step of another shape: an empty state/
  (step_dir.parent / "98" / "state").mkdir(parents=True)


def _junk_step_folder_with_a_file(step_dir):
  (step_dir.parent / "98" / "state").mkdir(parents=True)
  (step_dir.parent / "98" / "state" / "junk").write_text("junk")


def _junk_step_folder_state_a_file(step_dir):  # a stray copy outside Orbax's atomic rename
  (step_dir.parent / "98").mkdir()
  (step_dir.parent / "98" / "state").write_text("not a checkpoint")


JUNK_FOLDERS = (_junk_step_folder, _junk_step_folder_with_a_file, _junk_step_folder_state_a_file)
FAULTS = [_corrupt, _truncate, _junk_file, *JUNK_FOLDERS]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__.strip("_"))
def test_no_good_checkpoint_is_lost_for_a_bad_one(tmp_path, caplog, capfd, fault):
  """Good checkpoints 5 and 10 (``max_to_keep=2``), then a fault on the newest (or a junk
  newer folder). The restore falls back to the newest good one and moves the bad folder
  aside; training on saves the next steps as the trainer would, and every checkpoint left
  is good: none was deleted while a bad one was kept, the bad one is under unreadable/."""
  mgr = checkpoint.manager(tmp_path, max_to_keep=2)
  for step in (5, 10):
    checkpoint.save(mgr, step, make_state(float(step)), [{"epoch": step}])
  mgr.close()
  fault(tmp_path / "10")
  broken = sorted(set(os.listdir(tmp_path)) - {"5"} - ({"10"} if fault in JUNK_FOLDERS
                                                        else set()))
  mgr = checkpoint.manager(tmp_path, max_to_keep=2)
  step, state, _ = checkpoint.restore_latest(mgr, make_state(0.0))
  good = 10 if "10" not in broken else 5
  assert step == good
  np.testing.assert_array_equal(np.asarray(state["opt"].residual), float(good))
  assert f"checkpoint {broken[0]} in" in caplog.text and "moved to" in caplog.text
  # One warning line: the readers' own tracebacks (about 30 for a corrupt file) held back.
  assert "Traceback" not in caplog.text + capfd.readouterr().err
  assert sorted(os.listdir(tmp_path / checkpoint.UNREADABLE)) == broken
  for next_step in range(good + 5, 25, 5):  # the resumed run saves its next checkpoints
    checkpoint.save(mgr, next_step, make_state(float(next_step)), [{"epoch": next_step}])
  mgr.close()
  assert sorted(os.listdir(tmp_path)) == ["15", "20", checkpoint.UNREADABLE]
  for kept in (20, 15):
    mgr = checkpoint.manager(tmp_path)
    restored = checkpoint.restore_latest(mgr, make_state(0.0))
    mgr.close()
    assert restored[0] == kept
    np.testing.assert_array_equal(np.asarray(restored[1]["params"]), float(kept))
    _corrupt(tmp_path / str(kept))  # next round: the older good one is still there
  assert checkpoint.restore_latest(checkpoint.manager(tmp_path), make_state(0.0)) is None


def test_a_skipped_save_is_an_error_not_a_silent_loss(tmp_path):
  """Orbax returns quietly when asked to save a step at or below its latest one."""
  mgr = checkpoint.manager(tmp_path)
  checkpoint.save(mgr, 10, make_state(10.0), [])
  with pytest.raises(checkpoint.CheckpointNotWritten, match="checkpoint 5 was not written"):
    checkpoint.save(mgr, 5, make_state(5.0), [])
  mgr.close()


def test_another_train_state_names_the_leaves_on_one_side_only(tmp_path):
  write(tmp_path, [1])
  mgr = checkpoint.manager(tmp_path)
  like = make_state(0.0)
  like["opt"] = {"residual": like["opt"].residual, "velocity": like["opt"].residual}
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
  np.testing.assert_allclose(np.asarray(state["opt"].residual).sum(0), 2.0)


def test_a_state_type_that_gained_a_field_without_arrays_reads_older_checkpoints(tmp_path):
  """SyncState's ``built_for`` (its float leaf shapes, part of the pytree structure, no
  array) and ``placed`` (the device count its rows were laid out for, a fresh fold rule)
  came after checkpoints written without them: the restore reads the saved tree in its own
  structure and matches leaves by path, so those checkpoints still restore, bit for bit,
  ``placed`` taking this run's value."""
  import optax

  import spardl_jax as sj

  mesh = make_mesh(2)
  tx = optax.chain(sj.spardl(density=0.5, momentum=0.9), optax.sgd(0.1))
  params = jax.device_put({"w": jnp.zeros((6,))}, NamedSharding(mesh, P()))
  state = sj.init_opt_state(tx, params, mesh)
  rng = np.random.default_rng(0)
  state = jax.tree.map(lambda a: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype),
                                                a.sharding)
                       if jnp.issubdtype(a.dtype, jnp.floating) else a, state)
  sync = state[0]
  older = collections.namedtuple("SyncState", ["method_state", "velocity", "count", "stats"])
  mgr = checkpoint.manager(tmp_path, max_to_keep=3)
  checkpoint.save(mgr, 1, {"opt": (older(*sync[:4]), state[1])}, [{"epoch": 1}])
  step, restored, _ = checkpoint.restore_latest(mgr, {"opt": state})
  mgr.close()
  assert step == 1 and isinstance(restored["opt"][0], sj.states.SyncState)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves({"opt": state})):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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
  np.testing.assert_array_equal(np.asarray(state["opt"].residual), float(step))


def test_a_save_that_cannot_be_written_is_one_line_and_keeps_the_earlier_ones(tmp_path):
  """A disk that takes no more (here a file-size limit, which any user may set: the same
  write failure as a full disk): one line naming the step and the reason, none of the
  tracebacks Orbax's threads log, no partial folder, and the earlier checkpoint restores."""
  script = textwrap.dedent(f"""
      import logging, resource, signal, sys
      sys.path.insert(0, {REPO!r})
      import jax
      jax.config.update("jax_num_cpu_devices", 2)
      from tests.trainer.test_checkpoint import make_state
      from train import checkpoint
      logging.basicConfig()  # as the trainer does: every log line would show
      mgr = checkpoint.manager({str(tmp_path)!r})
      checkpoint.save(mgr, 1, make_state(1.0), [])
      signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
      resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))  # no byte more
      try:
        checkpoint.save(mgr, 2, make_state(2.0), [])
      except checkpoint.CheckpointNotWritten as error:
        print(error, file=sys.stderr)
      """)
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env=launch.child_environment(), timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stderr.strip().splitlines() == [
      f"checkpoint 2 could not be written to {tmp_path}: File too large; the earlier ones "
      f"are kept (the newest: 1)."], proc.stderr
  assert sorted(os.listdir(tmp_path)) == ["1"]
  step, state, _ = restore(tmp_path)
  assert step == 1
  np.testing.assert_array_equal(np.asarray(state["params"]), 1.0)


def test_a_sharded_run_restores_onto_another_data_axis_size(tmp_path):
  """A (4, 2) mesh's state, parameters sharded over "model", saved after a sparse step and
  restored onto (2, 2): the parameters and momentum keep their values and "model" sharding,
  and each column's residual mass is kept, spread over its new data devices. Onto (2, 4) it
  is refused, and the checkpoint stays."""
  import optax

  import spardl_jax as sj

  specs = {"w": P(None, "model"), "b": P()}

  def build(data, value, model=2):
    mesh = jax.make_mesh((data, model), ("data", "model"), devices=jax.devices()[:model * data],
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    params = {"w": jax.device_put(jnp.full((6, 4), value), NamedSharding(mesh, specs["w"])),
              "b": jax.device_put(jnp.full((4,), value), NamedSharding(mesh, specs["b"]))}
    tx = optax.chain(sj.spardl(density=0.25, param_specs=specs), optax.sgd(0.1, momentum=0.9))
    return mesh, tx, params, sj.init_opt_state(tx, params, mesh)

  mesh, tx, params, opt = build(4, 1.0)
  state_specs = sj.opt_state_specs(tx, params, mesh)

  def step(grads, opt):
    updates, opt = tx.update(jax.tree.map(lambda g: g[0], grads), opt, params)
    return opt

  grads = {k: jax.device_put(np.random.default_rng(0).standard_normal((4, *params[k].shape))
                             .astype(np.float32), NamedSharding(mesh, P("data", *specs[k])))
           for k in specs}
  opt = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=({k: P("data", *specs[k]) for k in specs},
                                                         state_specs),
                              out_specs=state_specs, check_vma=False))(grads, opt)
  saved = np.asarray(opt[0].method_state.residual)  # (8, n_local), data-major
  assert np.abs(saved).sum() > 0
  mgr = checkpoint.manager(tmp_path)
  checkpoint.save(mgr, 1, {"params": params, "opt": opt}, [{"epoch": 1}])
  mgr.close()
  _, _, like_params, like_opt = build(2, 0.0)
  mgr = checkpoint.manager(tmp_path)
  _, state, _ = checkpoint.restore_latest(mgr, {"params": like_params, "opt": like_opt})
  mgr.close()
  np.testing.assert_array_equal(np.asarray(state["params"]["w"]), 1.0)
  assert state["params"]["w"].sharding.spec == P(None, "model")
  np.testing.assert_array_equal(np.asarray(state["opt"][1][0].trace["w"]),
                                np.asarray(opt[1][0].trace["w"]))
  residual = np.asarray(state["opt"][0].method_state.residual)
  assert residual.shape == (4, saved.shape[1])
  np.testing.assert_allclose(residual.reshape(2, 2, -1).sum(0), saved.reshape(4, 2, -1).sum(0),
                             rtol=1e-5, atol=1e-6)
  # Onto another size of the model axis: refused, naming the leaf; the checkpoint stays.
  _, _, like_params, like_opt = build(2, 0.0, model=4)
  mgr = checkpoint.manager(tmp_path)
  with pytest.raises(checkpoint.CheckpointMismatch, match="method_state/residual has shape"):
    checkpoint.restore_latest(mgr, {"params": like_params, "opt": like_opt})
  mgr.close()
  assert (tmp_path / "1").is_dir() and not (tmp_path / "unreadable").exists()


def test_a_failure_while_rebuilding_leaves_the_checkpoint_in_place(tmp_path, monkeypatch):
  """Rebuilding a readable checkpoint onto other devices is our code, not the checkpoint: if
  it fails, the error propagates and the good checkpoint is not moved to unreadable/ (it was,
  once, when the fold code met Orbax's list of mesh axes)."""
  write(tmp_path, [1], devices=4)

  def broken(*args, **kwargs):
    raise RuntimeError("a bug in the fold")

  from spardl_jax._src.sync import refold

  monkeypatch.setattr(refold, "_fold", broken)
  with pytest.raises(RuntimeError, match="a bug in the fold"):
    restore(tmp_path, devices=2)
  assert (tmp_path / "1").is_dir() and not (tmp_path / "unreadable").exists()


def test_an_outer_loop_restores_onto_another_replica_count(tmp_path):
  """A DiLoCo state saved one inner step into a round on 4 devices, restored onto 2: every
  replica gets the mean offset (so the mean pseudo-gradient of the next outer step is
  unchanged), the inner momentum's mean likewise, the residual's total is kept, and the
  outer state and step count carry over."""
  import optax

  import spardl_jax as sj

  tx = sj.diloco(optax.sgd(0.1, momentum=0.9), sj.spardl(density=0.3), every=2)

  def build(devices):
    mesh = make_mesh(devices)
    params = jax.device_put(jnp.zeros((12,)), NamedSharding(mesh, P()))
    return mesh, params, sj.init_opt_state(tx, params, mesh)

  mesh, params, opt = build(4)
  specs = sj.opt_state_specs(tx, params, mesh)

  def step(params, grads, opt):
    updates, opt = tx.update(grads[0], opt, params)
    return optax.apply_updates(params, updates), opt

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), specs),
                              out_specs=(P(), specs), check_vma=False))
  rng = np.random.default_rng(0)
  for _ in range(3):  # an outer step, then one inner step
    params, opt = run(params, jax.device_put(rng.standard_normal((4, 12)).astype(np.float32),
                                             NamedSharding(mesh, P("data"))), opt)
  saved = jax.tree.map(np.asarray, opt)
  assert saved.offset.any() and saved.sync.method_state.residual.any()
  mgr = checkpoint.manager(tmp_path)
  checkpoint.save(mgr, 3, {"params": params, "opt": opt}, [{"epoch": 1}])
  mgr.close()
  _, like_params, like_opt = build(2)
  mgr = checkpoint.manager(tmp_path)
  _, state, _ = checkpoint.restore_latest(mgr, {"params": like_params, "opt": like_opt})
  mgr.close()
  got = jax.tree.map(np.asarray, state["opt"])
  np.testing.assert_array_equal(np.asarray(state["params"]), np.asarray(params))
  for new, old in ((got.offset, saved.offset), (got.inner[0].trace, saved.inner[0].trace)):
    np.testing.assert_allclose(new, np.repeat(old.mean(0, keepdims=True), 2, axis=0),
                               rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(got.sync.method_state.residual.sum(0),
                             saved.sync.method_state.residual.sum(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got.outer[0].trace, saved.outer[0].trace)
  assert int(got.count) == 3
