"""The trainer: no hidden dense all-reduce, a smoke run of the CLI, every task trains, a
bit-identical resume from a checkpoint, restore onto other device counts, and flags checked
before any work. Convergence is a benchmark (python -m benchmarks.convergence), not a test."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from models import create
import spardl_jax as sj
from spardl_jax._src.parallel.rows import shard_rows
from spardl_jax.tools import traffic
from tests import harness
from train import data, input_pipeline, main
from train.config import TrainConfig, Tuning, Variant
from train import compile_steps, create_train_state, make_mesh, make_optimizer, \
    train_and_evaluate, variant_tuning

SPARDL = Variant("spardl", "spardl", {"density": 0.01})


@pytest.fixture(scope="module")
def digits():
  return data.load("digits")


def compiled_train_step(cfg, ds, variant):
  mesh = make_mesh(cfg.devices)
  model = create(cfg.model, cfg.model_size, **ds.info)
  tx = make_optimizer(cfg, variant)
  state, specs = create_train_state(jax.random.key(0), model, tx,
                                    ds.train.take(np.arange(1))[0], mesh, "data")
  train, _ = compile_steps(model, tx, mesh, specs, "data")
  batch = shard_rows(
      next(input_pipeline.train_batches(ds.train, cfg.batch_size, mesh, "data", seed=0,
                                        epoch=1)), mesh, local=True)
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  return traffic.parse_hlo(train.lower(state, batch).compile().as_text()), num_params


def test_train_step_has_no_dense_gradient_allreduce(digits):
  """The gradient trap: only scalar metrics may be all-reduced; the gradient goes sparse."""
  cfg = TrainConfig(model="mlp", dataset="digits", devices=4, batch_size=64)
  hlo, num_params = compiled_train_step(cfg, digits, SPARDL)
  assert hlo.rounds == 4  # 2 ceil(log2 4) SparDL rounds
  # Only scalars: the batch's total weight, and the loss and metric sums.
  assert hlo.others and hlo.largest_other() <= 2
  assert num_params > 1000


def test_the_trap_detector_sees_a_hidden_psum():
  """Control: jax.grad of replicated params with check_vma=True does all-reduce densely."""
  mesh = make_mesh(4)
  w = jnp.ones((64, 32))

  def grads(w, x):
    return jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)[None]

  f = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(P(), P("data")),
                            out_specs=P("data")))
  x = jax.device_put(jnp.ones((8, 64)), jax.sharding.NamedSharding(mesh, P("data")))
  hlo = traffic.parse_hlo(f.lower(w, x).compile().as_text())
  assert hlo.largest_other() == w.size


def test_cli_smoke_run_writes_metrics_and_plot(tmp_path):
  out = tmp_path / "run"
  rc = main.main(["--dataset", "digits", "--model", "mlp", "--model-size", "tiny", "--epochs",
                  "1", "--devices", "4", "--batch-size", "64", "--out", str(out),
                  "--no-progress", "--compare",
                  "dense,spardl:residuals=local,oktopk:tau=4"])
  assert rc == 0
  for name in ("metrics.json", "metrics.csv", "accuracy.png", "results.md"):
    assert os.path.getsize(out / name) > 0
  runs = json.loads((out / "metrics.json").read_text())["runs"]
  table = (out / "results.md").read_text().splitlines()
  assert [line.split(" | ")[0] for line in table[2:]] == [
      "| dense", "| spardl:residuals=local", "| oktopk:tau=4"]
  assert table[2].endswith(f"| {runs[0]['bytes_per_step']:,.0f} | "
                           f"{runs[0]['time_per_step'] * 1e3:.1f} |")
  assert [r["method"] for r in runs] == ["dense", "spardl:residuals=local", "oktopk:tau=4"]
  assert runs[1]["bytes_per_step"] < runs[0]["bytes_per_step"]
  assert runs[2]["bytes_per_step"] < runs[0]["bytes_per_step"]
  # What the recipe applied is recorded: SGD's recommended recipe lowers the momentum of
  # the sparse variants, not dense's.
  assert [r["tuning"] for r in runs] == [{}, {"opt_momentum": 0.5}, {"opt_momentum": 0.5}]


def measured(history):
  """A history without its wall clock (``train_seconds`` grows, and differs run to run)."""
  clocks = [h["train_seconds"] for h in history]
  assert all(0 < a < b for a, b in zip(clocks, clocks[1:])), clocks
  return [{k: v for k, v in h.items() if k != "train_seconds"} for h in history]


def test_resume_from_checkpoint_is_bit_identical(digits, tmp_path):
  """Residuals and the B-SAG h controller (6 devices in 3 teams) resume exactly."""
  cfg = TrainConfig(model="mlp", model_size="tiny", dataset="digits", devices=6, epochs=2,
                    batch_size=60)
  variant = Variant("spardl:teams=3", "spardl", {"density": 0.01, "teams": 3, "sag": "bruck"})
  mesh = make_mesh(6)
  ckpt = str(tmp_path / "ckpt")
  # The run that writes the checkpoints is the uninterrupted one (saving changes nothing);
  # without its last checkpoint, the resume starts from the end of epoch 1.
  whole = train_and_evaluate(cfg, variant, digits, mesh, progress=False, checkpoint_dir=ckpt)
  method_state = whole.state.opt_state[0].method_state
  assert np.any(np.asarray(method_state.residual))
  assert np.asarray(method_state.controller.h)[0] > 0  # the controller has run
  from train import checkpoint
  mgr = checkpoint.manager(ckpt)
  steps = mgr.all_steps()
  mgr.delete(steps[-1])
  mgr.close()
  assert len(steps) == 2
  resumed = train_and_evaluate(cfg, variant, digits, mesh, progress=False, checkpoint_dir=ckpt)
  for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert measured(resumed.history) == measured(whole.history)


def test_resume_mid_epoch_is_bit_identical(digits, tmp_path):
  """A checkpoint every 4 steps and at each epoch's end (10 steps an epoch: 4, 8, 10, 12, 16,
  20; the manager keeps the newest two). Without the epoch-2 end, the newest is step 16, step
  6 of epoch 2: resumed from there, the rest of the epoch repeats exactly (state and history
  equal an uninterrupted run's). The sync warms up densely for 5 steps, then moves through
  DGC's density schedule until step 17 with momentum correction: the step 16 checkpoint
  resumes inside the schedule with its velocity."""
  cfg = TrainConfig(model="mlp", model_size="tiny", dataset="digits", devices=4, epochs=2,
                    batch_size=64, steps_per_epoch=10, checkpoint_every=4)
  mesh = make_mesh(4)
  variant = Variant("spardl", "spardl", {"density": 0.01},
                    Tuning(warmup=5, ramp=12, momentum=0.9))
  ckpt = str(tmp_path / "ckpt")
  # Saving changes nothing of the run, so the run that writes the checkpoints is the
  # uninterrupted one.
  whole = train_and_evaluate(cfg, variant, digits, mesh, progress=False, checkpoint_dir=ckpt)
  assert np.any(np.asarray(whole.state.opt_state[0].velocity))
  from train import checkpoint
  mgr = checkpoint.manager(ckpt)
  assert mgr.all_steps() == [16, 20]
  mgr.delete(20)  # as if the run had stopped inside epoch 2
  mgr.close()
  resumed = train_and_evaluate(cfg, variant, digits, mesh, progress=False, checkpoint_dir=ckpt)
  for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert measured(resumed.history) == measured(whole.history)


def test_resume_inside_an_outer_round_is_bit_identical(digits, tmp_path):
  """An outer loop of 3 steps (SparDL at 10 %, int4 values) checkpointed every 4 steps: the
  step-16 checkpoint lies one step into a round, with every device's offset and inner
  momentum in it; resumed from there, state and history equal an uninterrupted run's."""
  from train import checkpoint

  cfg = TrainConfig(model="mlp", model_size="tiny", dataset="digits", devices=4, epochs=2,
                    batch_size=64, steps_per_epoch=10, checkpoint_every=4)
  mesh = make_mesh(4)
  variant = Variant("spardl:outer=3", "spardl", {"density": 0.1, "wire": "int4"},
                    Tuning(outer=3))
  ckpt = str(tmp_path / "ckpt")
  whole = train_and_evaluate(cfg, variant, digits, mesh, progress=False, checkpoint_dir=ckpt)
  outer = whole.state.opt_state
  assert isinstance(outer, sj.states.DiLoCoState) and int(outer.count) == 20
  offsets = [np.asarray(leaf) for leaf in jax.tree.leaves(outer.offset)]
  assert all(o.shape[0] == 4 and o.any() for o in offsets)  # 20 = 6 rounds and 2 steps
  assert np.any(np.asarray(outer.sync.method_state.residual))
  mgr = checkpoint.manager(ckpt)
  mgr.delete(20)
  mgr.close()
  resumed = train_and_evaluate(cfg, variant, digits, mesh, progress=False, checkpoint_dir=ckpt)
  for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert measured(resumed.history) == measured(whole.history)
  assert 0 < whole.bytes_per_step < resumed.history[-1]["bytes_sent"]


def test_restore_onto_other_device_counts_keeps_residual_and_velocity_mass(digits, tmp_path):
  """8 -> 4 -> 6 devices with a dense warm-up and momentum correction: params carry over
  exactly, the residual and velocity totals and the sync's step count are kept, the h
  controller and statistics start afresh, and training goes on."""
  from train import checkpoint

  ckpt = str(tmp_path / "ckpt")
  cfg = TrainConfig(model="mlp", model_size="tiny", dataset="digits", epochs=1, batch_size=48,
                    steps_per_epoch=6)
  variant = Variant("spardl", "spardl", {"density": 0.05, "teams": 2},
                    Tuning(warmup=2, momentum=0.9, masking=1))
  before = train_and_evaluate(dataclasses.replace(cfg, devices=8), variant, digits,
                              make_mesh(8), progress=False, checkpoint_dir=ckpt)
  for devices, epochs in ((4, 2), (6, 3)):
    sync = before.state.opt_state[0]
    totals = {name: np.asarray(leaf, np.float64).sum(0)
              for name, leaf in (("residual", sync.method_state.residual),
                                 ("velocity", sync.velocity))}
    assert all(np.abs(t).max() > 0.01 for t in totals.values())
    run = dataclasses.replace(cfg, devices=devices, epochs=epochs)
    mesh = make_mesh(devices)
    tx = make_optimizer(run, variant)
    like, _ = create_train_state(jax.random.key(1), create("mlp", "tiny", num_classes=10), tx,
                                 digits.train.take(np.arange(1))[0], mesh, "data")
    mgr = checkpoint.manager(ckpt)
    step, state, progress = checkpoint.restore_latest(mgr, like)
    mgr.close()
    # Checkpoints are numbered by the steps taken (6 an epoch); the history has every epoch.
    assert step == 6 * (epochs - 1) and len(progress["history"]) == epochs - 1
    restored = state.opt_state[0]
    for name, leaf in (("residual", restored.method_state.residual),
                       ("velocity", restored.velocity)):
      assert leaf.shape[0] == devices
      np.testing.assert_allclose(np.asarray(leaf, np.float64).sum(0), totals[name], rtol=0,
                                 atol=1e-6 * np.abs(totals[name]).max())
    np.testing.assert_array_equal(restored.count, np.full(devices, step))
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before.state.params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(restored.method_state.controller),
                    jax.tree.leaves(like.opt_state[0].method_state.controller)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    before = train_and_evaluate(run, variant, digits, mesh, progress=False,
                                checkpoint_dir=ckpt)
    assert len(before.history) == epochs
    assert np.isfinite(before.history[-1]["test_loss"])


@pytest.mark.parametrize("model,dataset,seq_len", [
    ("lstm_ptb", "shakespeare", 32), ("bert", "shakespeare", 32), ("vgg11", "house", None),
    ("resnet20", "digits", None)])
def test_every_task_trains(tmp_path, model, dataset, seq_len):
  """Language model, masked LM, regression and batch norm, each a few steps with SparDL.

  The House stand-in's photos are noise, so its loss need not fall; the others must learn.
  """
  from tests import data_files
  from train import data_request

  if dataset == "house":
    data_files.write_house(tmp_path, houses=40)
  cfg = TrainConfig(model=model, model_size="tiny", dataset=dataset, devices=4, epochs=2,
                    batch_size=16, steps_per_epoch=8, eval_steps=4, seq_len=seq_len,
                    data_dir=str(tmp_path), lr=0.002 if dataset == "house" else 0.05)
  ds = data.load(dataset, data_request(cfg))
  result = train_and_evaluate(cfg, SPARDL, ds, make_mesh(4), progress=False)
  first, last = result.history
  assert 0 < result.bytes_per_step < 4 * result.num_params / 10
  assert np.isfinite(last["test_loss"]) and np.isfinite(last[f"test_{ds.metric}"])
  if dataset != "house":
    assert last["train_loss"] < first["train_loss"]
  if ds.task in ("lm", "mlm"):  # better than guessing uniformly among the characters
    assert first["train_loss"] < np.log(ds.info["vocab_size"])
  if model == "resnet20":  # batch-norm statistics moved, identically on every device
    stats = jax.tree.leaves(result.state.model_state)
    assert stats and all(np.asarray(s).std() > 0 for s in stats[:1])
    for s in stats:
      shards = [np.asarray(x.data) for x in s.addressable_shards]
      assert all(np.array_equal(shards[0], x) for x in shards)


@pytest.mark.parametrize("flags,message", [
    (["--epochs", "0"], "argument --epochs: must be >= 1, got 0"),
    (["--lr", "-1"], "argument --lr: must be > 0.0 and finite, got -1"),
    (["--lr", "nan"], "argument --lr: must be > 0.0 and finite, got nan"),
    (["--devices", "0"], "argument --devices: must be >= 1, got 0"),
    (["--momentum", "1"], "--momentum must be in [0, 1), got 1.0."),
    (["--outer-momentum", "1"], "--outer-momentum must be in [0, 1), got 1.0."),
    (["--outer-every", "-1"], "argument --outer-every: must be >= 0, got -1"),
    (["--compare", "spardl:outer_lr=0.5"], "outer_lr and outer_momentum (the outer loop's "
                                           "step) need outer=H"),
    (["--compare", "spardl:wire=int3"], "wire must be one of ('exact', 'compact', 'int8', "
                                        "'int4', 'int2'), got 'int3'"),
    (["--compare", "dense,nosuch"], "method spec 'nosuch': the method must be one of"),
    (["--compare", "dense,spardl:density=0"], "--compare 'spardl:density=0': SparDLConfig: "
                                               "density must be in (0, 1]"),
    (["--compare", "oktopk:tau=x"], "oktopk:tau=x': tau='x' is not a valid int"),
    (["--compare", "spardl:momentum=1"], "'spardl:momentum=1': momentum must be in [0, 1)"),
    (["--compare", "spardl:warmup=x"], "'spardl:warmup=x': warmup='x' is not a valid int"),
    (["--recipe", "fast"], "argument --recipe: invalid choice: 'fast'"),
    (["--batch-size", "100", "--devices", "8"], "--batch-size (100) must be a multiple of"),
    (["--dataset", "nosuch"], "--dataset must be one of"),
    (["--checkpoint-every", "1"], "--checkpoint-every saves inside an epoch, which needs "
                                  "--checkpoint."),
    (["--compare", "spardl:freeze=3"], "'spardl:freeze=3': freeze (Adam's second moment "
                                       "frozen) needs --optimizer adamw"),
    (["--compare", "spardl:masking=0"], "masking (DGC's momentum factor masking) needs "
                                        "momentum=M"),
    (["--compare", "spardl:synced=momentum"], "synced (Adam around the sync) needs "
                                              "--optimizer adamw"),
    (["--optimizer", "adamw", "--recipe", "paper", "--compare", "spardl:synced=momentum"],
     "synced trains Adam's second moment on the mean gradient of a dense warm-up and freezes "
     "it there: it needs warmup=N"),
    (["--compare", "spardl:synced=1"], "synced must be 'momentum' or 'preconditioned', got 1"),
    (["--optimizer", "adamw", "--compare", "spardl:second_moment=sent:momentum=0.9"],
     "second_moment (Adam's v after the warm-up) needs synced=momentum or "
     "synced=preconditioned in the same spec"),
    (["--compare", "spardl:lookahead=1"], "lookahead (the gradient taken one step ahead) "
                                          "needs delay=1 in the same spec"),
    (["--optimizer", "adamw", "--compare", "spardl:delay=1:lookahead=1"],
     "not synced= (Adam around the sync, the AdamW recipe's) nor outer=H"),
    (["--compare", "spardl:warmup=1:warmup=0"], "warmup given more than once"),
    (["--compare", "spardl:density=0.1:density=0.2"], "density given more than once"),
    (["--compare", "spardl,spardl", "--checkpoint"], "--compare lists 'spardl' more than once"),
    # Options that fit only some device counts or methods fail before the first variant trains.
    (["--compare", "dense,spardl", "--teams", "3"],
     "--compare 'spardl': SparDLConfig: teams=3 does not divide the 8 workers"),
    (["--compare", "dense,spardl:teams=3"], "teams=3 does not divide the 8 workers"),
    (["--compare", "dense,dense:ramp=2"], "ramp (a density warm-up) needs a sparse method with "
                                          "a density; 'dense' has none"),
    (["--compare", "dense,powersgd:ramp=2"], "'powersgd' has none"),
    (["--compare", "dense,powersgd:seed=100000000000000000000000"],
     "PowerSGDConfig: seed must be an int in [-2**63, 2**63)"),
    # A mesh of several axes (the base gives --devices 8).
    (["--mesh", "model=8"], "--mesh must have the data axis 'data', got axes ('model',)"),
    (["--mesh", "data=4,data=2"], "the axis 'data' is given twice"),
    (["--mesh", "data=four"], "give the mesh as axis=size pairs, e.g. data=4,model=2"),
    (["--mesh", "data=4,expert=2"],
     "--mesh knows the axes 'data' (the batch) and 'model' (parameters sharded FSDP-style); "
     "got 'expert'"),
    (["--mesh", "data=2,model=2"], "--devices 8 and --mesh (4 devices) disagree; give one"),
    (["--mesh", "data=4,model=2", "--compare", "dense,powersgd"],
     "'powersgd' compresses each parameter as a matrix, but some parameters are replicated"),
])
def test_bad_flags_fail_at_once_with_one_line(capsys, tmp_path, flags, message):
  """Every flag and variant is checked before any step runs; the error is one line naming
  the flag and what is allowed (no traceback), and nothing is written."""
  base = ["--dataset", "digits", "--model", "mlp", "--model-size", "tiny", "--devices", "8",
          "--batch-size", "64", "--epochs", "1", "--steps-per-epoch", "1"]
  try:
    code = main.main(base + flags + ["--no-progress", "--out", str(tmp_path / "out")])
  except SystemExit as exit_:  # argparse's own checks
    code = exit_.code
  assert code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert message in err[-1] and "Traceback" not in "\n".join(err)
  assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_an_unwritable_out_fails_before_training(capsys, tmp_path):
  (tmp_path / "file").write_text("")
  code = main.main(["--dataset", "digits", "--model", "mlp", "--model-size", "tiny",
                    "--no-progress", "--out", str(tmp_path / "file" / "out")])
  assert code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "--out" in err[0] and "cannot be written" in err[0], err


def test_resume_with_other_flags_is_refused_and_nothing_is_lost(tmp_path, capsys):
  """A checkpointed run, then the same directory with one flag changed: one line names the
  flag and both values, no step runs, and the checkpoints are as they were."""
  base = ["--dataset", "digits", "--model", "mlp", "--model-size", "tiny", "--devices", "4",
          "--batch-size", "64", "--steps-per-epoch", "3", "--epochs", "1", "--method",
          "spardl", "--checkpoint", "--no-progress", "--out", str(tmp_path)]
  assert main.main(base) == 0
  ckpt = tmp_path / "checkpoints" / "spardl"
  before = sorted(os.listdir(ckpt))
  capsys.readouterr()
  for flags, names in [
      (["--steps-per-epoch", "2"], "--steps-per-epoch (steps an epoch) 3 there, 2 here"),
      (["--recipe", "paper"], "--recipe 'recommended' there, 'paper' here"),
      (["--density", "0.02"], "option density 0.01 there, 0.02 here"),
      (["--momentum", "0.5"], "--momentum 0.9 there, 0.5 here"),
      (["--lr", "0.1"], "--lr 0.05 there, 0.1 here")]:
    assert main.main(base + flags + ["--epochs", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was written by another run" in err[0] and names in err[0], err
    assert sorted(os.listdir(ckpt)) == before
  assert main.main(base + ["--epochs", "2"]) == 0  # the same flags resume
  assert sorted(os.listdir(ckpt)) == ["3", "6"]


def test_a_failing_variant_keeps_the_results_before_it(tmp_path, monkeypatch):
  """Results are written after each variant: a failure in the second keeps the first's."""
  calls = []

  def train(cfg, variant, *args, **kwargs):
    calls.append(variant.label)
    if len(calls) == 2:
      raise ValueError("the second variant failed")
    return real(cfg, variant, *args, **kwargs)

  from train import train as train_module
  real = train_module.train_and_evaluate
  monkeypatch.setattr("train.train.train_and_evaluate", train)
  with pytest.raises(ValueError, match="the second variant failed"):
    main.run(main._parse_args(["--dataset", "digits", "--model", "mlp", "--model-size", "tiny",
                               "--devices", "4", "--batch-size", "64", "--epochs", "1",
                               "--steps-per-epoch", "2", "--compare", "dense,spardl",
                               "--no-progress", "--out", str(tmp_path)]))
  runs = json.loads((tmp_path / "metrics.json").read_text())["runs"]
  assert [r["method"] for r in runs] == ["dense"]



@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sync_tuning_keys_reach_the_sync(optimizer, monkeypatch):
  """`spardl:balance=leaves:dense_leaves=vectors:delay=1` builds its sync (plain, or inside
  the AdamW recipe) with those options."""
  from spardl_jax._src.sync.settings import SyncOptions
  from train.config import parse_variant
  built = []

  def recording(options):
    built.append(dataclasses.asdict(options))
    checked(options)

  checked = SyncOptions.__post_init__
  monkeypatch.setattr(SyncOptions, "__post_init__", recording)
  v = parse_variant("spardl:balance=leaves:dense_leaves=vectors:delay=1"
                    + (":synced=momentum:warmup=2" if optimizer == "adamw" else ""),
                    density=0.01, teams=1, sag="auto", residuals="global")
  make_optimizer(TrainConfig(model="mlp", dataset="digits", optimizer=optimizer), v,
                 steps_per_epoch=10)
  assert len(built) == 1
  assert {k: built[0][k] for k in ("balance", "dense_leaves", "delay")} == {
      "balance": "leaves", "dense_leaves": "vectors", "delay": 1}


def test_sign_builds_demo_in_place_of_the_recipe(caplog):
  """`spardl:sign=1:decay=0.9` under AdamW is sj.demo: the sync decays its residual by 0.9
  with no Adam around it (the recipe's synced= dropped; the run says so), and the update of
  a step is -lr * (sign(result) + weight decay * params); a spec it cannot act on is
  refused."""
  import logging

  from train.config import parse_variant
  cfg = TrainConfig(model="mlp", dataset="digits", optimizer="adamw", lr=0.01,
                    weight_decay=0.5, weight_decay_on="all")
  v = parse_variant("spardl:sign=1:decay=0.9:warmup=0:wire=exact", density=0.5, teams=1,
                    sag="auto", residuals="global")
  with caplog.at_level(logging.INFO, logger="train"):
    tx = make_optimizer(cfg, v, steps_per_epoch=10)
  assert "sign=1 trains DeMo (the sign of the synced momentum) in place of --optimizer adamw" \
      in caplog.text
  # A matrix: the AdamW recipe keeps 1-D leaves dense, outside the method.
  params = {"w": jnp.ones((2, 4), jnp.float32)}
  p = 2
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  assert sj.sync_stats(state) is not None and not hasattr(state[0], "mu")
  g = np.tile(np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4), (p, 1, 1))
  updates, _ = harness.update_fn(tx, p, params)(harness.put_rows(p, {"w": g}), state)
  y = np.where(np.abs(g[0]) >= np.sort(np.abs(g[0]), axis=None)[-4], g[0], 0)  # top half
  np.testing.assert_allclose(updates["w"], -0.01 * (np.sign(y) + 0.5), rtol=1e-6)
  for bad in ("dense:sign=1", "spardl:sign=1:synced=momentum:warmup=2",
              "spardl:sign=1:outer=2"):
    with pytest.raises(ValueError, match="sign=1 .DeMo"):
      make_optimizer(cfg, parse_variant(bad, density=0.01, teams=1, sag="auto",
                                        residuals="global"), steps_per_epoch=10)


def test_the_adamw_recipe_is_the_nanogpt_finalist():
  """Under --optimizer adamw the recommended recipe gives SparDL the finalist of
  benchmarks/results/adam.md (7 %, 8-bit values, 1-D leaves dense); a spec's or a flag's
  option wins, other sparse methods keep --density's default, and neither an outer loop nor
  --recipe paper nor SGD takes it."""
  from train.main import _parse_args, _variants

  def options(*argv):
    return [v.options for v in _variants(_parse_args(["--compare", *argv]))]

  finalist, topka, given = options("spardl,topka,spardl:density=0.02:wire=exact",
                                   "--optimizer", "adamw")
  assert (finalist["density"], finalist["wire"], topka["density"]) == (0.07, "int8", 0.01)
  assert (given["density"], given["wire"]) == (0.02, "exact")
  assert options("spardl", "--optimizer", "adamw", "--density", "0.03")[0]["density"] == 0.03
  for argv in (("spardl:outer=4", "--optimizer", "adamw"),
               ("spardl", "--optimizer", "adamw", "--recipe", "paper"),
               ("spardl", "--outer-every", "4", "--optimizer", "adamw"), ("spardl",)):
    plain = options(*argv)[0]
    assert plain["density"] == 0.01 and "wire" not in plain, argv
  assert variant_tuning(TrainConfig(optimizer="adamw"), SPARDL,
                        steps_per_epoch=8).dense_leaves == "vectors"
  assert variant_tuning(TrainConfig(), SPARDL, steps_per_epoch=8).dense_leaves is None


def test_variant_tuning_and_recipes():
  """Tuning keys split from the method's options; the recipe fills what a sparse variant
  leaves out (never a dense one), epochs turned into steps; --recipe paper adds nothing."""
  from train.config import RECIPES, parse_variant, recipe_tuning

  v = parse_variant("spardl:warmup=31:density=0.05:momentum=0.9", density=0.01, teams=1,
                    sag="auto", residuals="global")
  assert v.method == "spardl" and v.options["density"] == 0.05
  assert v.tuning.given() == {"warmup": 31, "momentum": 0.9}
  assert recipe_tuning("paper", optimizer="sgd", steps_per_epoch=31) == Tuning()
  # SparseLoCo's outer loop as a spec: its method's options (bits=none: float values), the
  # decayed error feedback and a plain outer step.
  loco = parse_variant("sparseloco:density=0.03:bits=none:outer=4:outer_momentum=0:decay=0.9",
                       density=0.01, teams=1, sag="auto", residuals="global")
  assert loco.options == {"density": 0.03, "bits": None}
  assert loco.tuning.given() == {"outer": 4, "outer_momentum": 0.0, "decay": 0.9}
  params = {"w": jnp.zeros((4, 10))}  # a matrix: the AdamW recipe keeps 1-D leaves dense
  state = sj.init_opt_state(make_optimizer(TrainConfig(), loco, steps_per_epoch=10), params,
                            make_mesh(2))
  assert not jax.tree.leaves(state.outer) and state.sync.method_state.residual.shape == (2, 40)
  # With AdamW, a spec with DGC's momentum correction keeps Adam after the sync: the
  # recipe's Adam-around-the-sync keys drop out, its warm-up stays.
  dgc = variant_tuning(TrainConfig(optimizer="adamw"),
                       parse_variant("spardl:momentum=0.9", density=0.01, teams=1, sag="auto",
                                     residuals="global"), steps_per_epoch=8)
  # The warm-up, 1.25 % of the run's 30 epochs of 8 steps: 3 steps. DGC's velocity is the
  # sparse vector's alone: the recipe's dense leaves drop out too (they were refused by a
  # message naming dense_leaves, a key the spec did not give).
  assert (dgc.synced, dgc.second_moment, dgc.momentum, dgc.warmup) == (None, None, 0.9, 3)
  assert dgc.dense_leaves is None
  make_optimizer(TrainConfig(optimizer="adamw"), parse_variant(
      "spardl:momentum=0.9", density=0.01, teams=1, sag="auto", residuals="global"),
                 steps_per_epoch=8)
  mesh = make_mesh(2)
  for recipe in RECIPES:
    for optimizer in ("sgd", "adamw"):
      cfg = TrainConfig(recipe=recipe, optimizer=optimizer)
      want = recipe_tuning(recipe, optimizer=optimizer, steps_per_epoch=10, epochs=cfg.epochs)
      state = sj.init_opt_state(make_optimizer(cfg, SPARDL, steps_per_epoch=10), params, mesh)
      if want.synced:  # Adam around the sync: its first moment is what is synced
        # 1.25 % of 30 epochs of 10 steps: 4 steps.
        assert isinstance(state[0], sj.states.ScaleBySyncedAdamState) and want.warmup == 4
        assert state[0].sync.velocity is None
      else:
        assert (state[0].velocity is not None) == (want.momentum is not None)
      dense = sj.init_opt_state(make_optimizer(cfg, Variant("dense", "dense", {}),
                                               steps_per_epoch=10), params, mesh)
      assert dense[0].velocity is None


def test_a_two_axis_mesh_shards_the_model_and_trains_like_one_axis(digits):
  """``--mesh data=4,model=2``: the MLP's matrices are sharded over "model" (FSDP-style), its
  biases replicated, the sync's rows are one per device, and at density 1 on the exact wire
  the run equals the one-axis run on the same data split (4 devices on "data")."""
  exact = Variant("spardl:density=1", "spardl", {"density": 1.0, "wire": "exact"})
  base = dict(model="mlp", dataset="digits", epochs=1, batch_size=32, steps_per_epoch=4,
              eval_steps=2, recipe="paper")
  one = train_and_evaluate(TrainConfig(devices=4, **base), exact, digits, make_mesh(4),
                           progress=False)
  cfg = TrainConfig(mesh=(("data", 4), ("model", 2)), **base)
  two = train_and_evaluate(cfg, exact, digits, make_mesh(axes=cfg.mesh), progress=False)
  specs = {jax.tree_util.keystr(k): x.sharding.spec
           for k, x in jax.tree_util.tree_flatten_with_path(two.state.params)[0]}
  assert specs["['Dense_0']['kernel']"] == P(None, "model")  # (64, 128): its largest dim
  assert specs["['Dense_1']['kernel']"] == P("model", None)  # (128, 10)
  assert specs["['Dense_0']['bias']"] == P()
  residual = two.state.opt_state[0].method_state.residual
  assert residual.sharding.spec == P(("data", "model")) and residual.shape[0] == 8
  for a, b in zip(jax.tree.leaves(one.state.params), jax.tree.leaves(two.state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  assert one.history[-1]["test_accuracy"] == pytest.approx(two.history[-1]["test_accuracy"])


def test_vector_regression_scores_every_feature():
  """The teacher case's targets are vectors: the loss is the squared error of each feature
  (its weighted mean over features and examples is the guide's jnp.mean), the metric the
  absolute error; scalar targets read the model's one output column."""
  from train.train import _loss_terms

  out = jnp.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
  y = jnp.array([[1.0, 0.0, 4.0], [1.0, -2.0, 0.0]])
  losses, metric = _loss_terms("regress", out, y)
  np.testing.assert_allclose(losses, [[0, 4, 1], [1, 4, 0]])
  np.testing.assert_allclose(metric, [[0, 2, 1], [1, 2, 0]])
  losses, _ = _loss_terms("regress", jnp.array([[2.0], [3.0]]), jnp.array([1.0, 5.0]))
  np.testing.assert_allclose(losses, [1, 4])


def test_adam_around_a_low_rank_sync_trains_v_as_the_recipe_does():
  """powersgd:synced=momentum:warmup=1 once froze v after one warm-up step (one sample of the
  mean gradient's square, near 0 for some coordinates) and reached a loss of 577 in two
  steps: v now trains where the sync delivers, as the AdamW recipe's sparse methods do."""
  from train.config import TrainConfig, parse_variant
  from train import variant_tuning

  cfg = TrainConfig(optimizer="adamw")
  variant = parse_variant("powersgd:synced=momentum:warmup=1", density=0.01, teams=1,
                          sag="auto", residuals="global")
  assert variant_tuning(cfg, variant, steps_per_epoch=10).second_moment == "sent"
  frozen = parse_variant("powersgd:synced=momentum:warmup=1:second_moment=frozen",
                         density=0.01, teams=1, sag="auto", residuals="global")
  assert variant_tuning(cfg, frozen, steps_per_epoch=10).second_moment == "frozen"


def test_density_auto_from_the_flag_and_a_spec(capsys):
  """--density auto works as a spec's density=auto does (any case); a bad one is one line."""
  from train.config import parse_variant
  from train.main import _parse_args

  assert _parse_args(["--density", "auto"]).density == "auto"
  assert parse_variant("spardl:density=Auto", density=0.01, teams=1, sag="auto",
                       residuals="global").options["density"] == "auto"
  with pytest.raises(SystemExit):
    _parse_args(["--density", "2"])
  assert "must be in (0, 1] or 'auto', got 2" in capsys.readouterr().err
  with pytest.raises(ValueError, match=r"density='x' is not a valid density \(a number in "
                                       r"\(0, 1\], or 'auto'\)"):
    parse_variant("spardl:density=x", density=0.01, teams=1, sag="auto", residuals="global")
