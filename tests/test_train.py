"""The trainer: no hidden dense all-reduce, a smoke run of the CLI, convergence with SparDL on
real offline data, and a bit-identical resume from a checkpoint."""

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
from spardl_jax import traffic
from train import input_pipeline, main
from train.config import TrainConfig, Variant
from train.train import compile_steps, create_train_state, make_mesh, make_optimizer, \
    train_and_evaluate

SPARDL = Variant("spardl", "spardl", {"density": 0.01})


@pytest.fixture(scope="module")
def digits():
  return input_pipeline.load("digits")


def compiled_train_step(cfg, ds, variant):
  mesh = make_mesh(cfg.devices)
  model = create(cfg.model, cfg.model_size, **ds.info)
  tx = make_optimizer(cfg, variant)
  state, specs = create_train_state(jax.random.key(0), model, tx,
                                    ds.train.take(np.arange(1))[0], mesh, "data")
  train, _ = compile_steps(model, tx, mesh, specs, "data")
  batch = sj.data_parallel.shard_rows(
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
  for name in ("metrics.json", "metrics.csv", "accuracy.png"):
    assert os.path.getsize(out / name) > 0
  runs = json.loads((out / "metrics.json").read_text())["runs"]
  assert [r["method"] for r in runs] == ["dense", "spardl:residuals=local", "oktopk:tau=4"]
  assert runs[1]["bytes_per_step"] < runs[0]["bytes_per_step"]
  assert runs[2]["bytes_per_step"] < runs[0]["bytes_per_step"]


def test_spardl_reaches_accuracy_on_digits(digits):
  """SparDL at 1 % on 8 devices: >= 95 % test accuracy on digits within 16 epochs (352 steps).

  Dense reaches 97 % here; SparDL at 1 % sends 46x fewer bytes and gets there later.
  """
  cfg = TrainConfig(model="mlp", dataset="digits", devices=8, epochs=16, batch_size=64, lr=0.1)
  result = train_and_evaluate(cfg, SPARDL, digits, make_mesh(8), progress=False)
  assert max(h["test_accuracy"] for h in result.history[-3:]) >= 0.95


def test_resume_from_checkpoint_is_bit_identical(digits, tmp_path):
  cfg = TrainConfig(model="mlp", model_size="tiny", dataset="digits", devices=4, epochs=2,
                    batch_size=64)
  mesh = make_mesh(4)
  whole = train_and_evaluate(cfg, SPARDL, digits, mesh, progress=False)
  ckpt = str(tmp_path / "ckpt")
  first = train_and_evaluate(dataclasses.replace(cfg, epochs=1), SPARDL, digits, mesh,
                             progress=False, checkpoint_dir=ckpt)
  assert np.any(np.asarray(first.state.opt_state[0].method_state.residual))
  resumed = train_and_evaluate(cfg, SPARDL, digits, mesh, progress=False, checkpoint_dir=ckpt)
  for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert resumed.history == whole.history
