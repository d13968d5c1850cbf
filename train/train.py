"""Data-parallel training with a gradient sync from spardl_jax (Flax + optax + shard_map).

The train step runs inside ``jax.shard_map`` over the data axis. Each device computes the
gradient of its own batch slice and the optimizer's first transformation synchronizes it.
Two details make the sync really sparse:

* **the gradient trap**: the parameters arrive replicated, and ``jax.grad`` of a replicated
  input inside ``shard_map`` returns an already ``psum``-ed gradient (a hidden dense
  all-reduce). The step casts them to *varying* first (``jax.lax.pcast``), so the gradient
  stays local; ``tests/test_train.py`` checks the compiled step has no gradient-sized
  all-reduce.
* the synchronized gradient is bit-identical on all devices but typed *varying*, so the step
  uses ``check_vma=False`` to return the new parameters replicated.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec
from tqdm.auto import tqdm

import spardl_jax as sj
from train import input_pipeline
from train.config import TrainConfig, Variant

log = logging.getLogger("train")


@flax.struct.dataclass
class TrainState:
  """``step`` () int32; ``params`` replicated; ``opt_state`` with per-device residuals."""

  step: jax.Array
  params: Any
  opt_state: Any


class StepMetrics(NamedTuple):
  """Global mean loss and accuracy of one train step's batch (float32 scalars)."""

  loss: jax.Array
  accuracy: jax.Array


def make_mesh(devices: int, axis_name: str = "data") -> jax.sharding.Mesh:
  """A 1-D mesh over the first ``devices`` devices of the default backend."""
  available = jax.devices()
  if not 1 <= devices <= len(available):
    raise ValueError(f"--devices must be in [1, {len(available)}] (devices available on "
                     f"{available[0].platform}), got {devices}.")
  return jax.make_mesh((devices,), (axis_name,), devices=available[:devices],
                       axis_types=(jax.sharding.AxisType.Explicit,))


def make_optimizer(cfg: TrainConfig, variant: Variant) -> optax.GradientTransformation:
  """The variant's gradient sync followed by SGD with momentum."""
  return optax.chain(
      sj.sync_gradients(variant.method, axis_name=cfg.axis_name, **variant.options),
      optax.sgd(cfg.lr, momentum=cfg.momentum))


def create_train_state(rng: jax.Array, model: nn.Module, tx: optax.GradientTransformation,
                       example_x: np.ndarray, mesh: jax.sharding.Mesh, axis_name: str
                       ) -> tuple[TrainState, TrainState]:
  """Initial state (params replicated, residuals sharded) and its PartitionSpecs."""
  params = jax.jit(model.init)(rng, jnp.asarray(example_x[:1]))["params"]
  step, params = jax.device_put((jnp.zeros((), jnp.int32), params),
                                jax.sharding.NamedSharding(mesh, PartitionSpec()))
  opt_state = sj.init_opt_state(tx, params, mesh, axis_name=axis_name)
  state = TrainState(step=step, params=params, opt_state=opt_state)
  specs = TrainState(step=PartitionSpec(), params=jax.tree.map(lambda _: PartitionSpec(), params),
                     opt_state=sj.opt_state_specs(tx, params, mesh, axis_name=axis_name))
  return state, specs


def _cross_entropy(logits, labels, weight):
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
  return jnp.sum(losses * weight), jnp.sum(correct * weight)


def train_step(state: TrainState, batch, *, model: nn.Module, tx: optax.GradientTransformation,
               axis_name: str) -> tuple[TrainState, StepMetrics]:
  """One step on this device's slice ``batch = (x (b, ...), y (b,))``; inside shard_map."""
  x, y = batch
  ones = jnp.ones(y.shape, jnp.float32)

  def loss_fn(params):
    loss_sum, correct = _cross_entropy(model.apply({"params": params}, x), y, ones)
    return loss_sum / y.shape[0], correct

  # Varying params keep the gradient local (see the module docstring).
  local_params = jax.lax.pcast(state.params, axis_name, to="varying")
  (loss, correct), grads = jax.value_and_grad(loss_fn, has_aux=True)(local_params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = StepMetrics(loss=jax.lax.pmean(loss, axis_name),
                        accuracy=jax.lax.pmean(correct / y.shape[0], axis_name))
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params, batch, *, model: nn.Module, axis_name: str) -> jax.Array:
  """``(3,)`` float32 sums over the global batch: loss, correct, count (padding excluded)."""
  x, y, weight = batch
  loss_sum, correct = _cross_entropy(model.apply({"params": params}, x), y, weight)
  return jax.lax.psum(jnp.stack([loss_sum, correct, jnp.sum(weight)]), axis_name)


def compile_steps(model: nn.Module, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh,
                  specs: TrainState, axis_name: str):
  """``(train, evaluate)``: the jitted shard_map programs of the two steps."""
  rows = PartitionSpec(axis_name)
  train = jax.jit(jax.shard_map(
      functools.partial(train_step, model=model, tx=tx, axis_name=axis_name), mesh=mesh,
      in_specs=(specs, rows), out_specs=(specs, PartitionSpec()), check_vma=False))
  evaluate = jax.jit(jax.shard_map(
      functools.partial(eval_step, model=model, axis_name=axis_name), mesh=mesh,
      in_specs=(specs.params, rows), out_specs=PartitionSpec()))
  return train, evaluate


def _host(x) -> np.ndarray:
  """This process's first copy/row of ``x`` (whole arrays may span processes)."""
  return np.asarray(x.addressable_data(0))


class RunResult(NamedTuple):
  """What one variant's training produced.

  Attributes:
    variant: the label.
    history: one dict per epoch (train/test loss and accuracy, cumulative bytes sent).
    num_params: parameters (float entries synchronized per step).
    bytes_per_step: bytes each device sent per step.
    time_per_step: median wall seconds of a train step (compiled, waited for).
    state: the final train state.
  """

  variant: str
  history: list
  num_params: int
  bytes_per_step: float
  time_per_step: float
  state: TrainState


def evaluate_model(evaluate, params, ds, mesh, cfg: TrainConfig) -> tuple[float, float]:
  """Test-set mean loss and accuracy."""
  total = np.zeros(3)
  for batch in input_pipeline.eval_batches(ds, cfg.batch_size):
    total += _host(evaluate(params, sj.data_parallel.shard_rows(batch, mesh, cfg.axis_name)))
  return total[0] / total[2], total[1] / total[2]


def train_and_evaluate(cfg: TrainConfig, variant: Variant, ds: input_pipeline.Dataset,
                       mesh: jax.sharding.Mesh, *, progress: bool = True,
                       checkpoint_dir: str | None = None) -> RunResult:
  """Trains ``cfg.model`` on ``ds`` with ``variant``'s gradient sync for ``cfg.epochs``.

  With ``checkpoint_dir``, the state is saved after every epoch and a run that finds a
  checkpoint there resumes after its epoch (each epoch's data order depends only on the seed
  and the epoch, so the resumed run is bit-identical to an uninterrupted one).
  """
  from models import create
  from train import checkpoint

  if cfg.batch_size % cfg.devices:
    raise ValueError(f"--batch-size ({cfg.batch_size}) must be a multiple of --devices "
                     f"({cfg.devices}).")
  model = create(cfg.model, ds.num_classes, cfg.model_size)
  tx = make_optimizer(cfg, variant)
  state, specs = create_train_state(jax.random.key(cfg.seed), model, tx, ds.x_train, mesh,
                                    cfg.axis_name)
  train, evaluate = compile_steps(model, tx, mesh, specs, cfg.axis_name)
  num_params = sum(x.size for x in jax.tree.leaves(state.params))
  history, times, sent, first = [], [], 0.0, 1
  mgr = checkpoint.manager(checkpoint_dir) if checkpoint_dir else None
  restored = mgr and checkpoint.restore_latest(mgr, state)
  if restored:
    done, state, history = restored
    first, sent = done + 1, history[-1]["bytes_sent"]
    log.info("%s: resumed from %s after epoch %d", variant.label, checkpoint_dir, done)
  steps_per_epoch = len(ds.y_train) // cfg.batch_size
  bar = tqdm(total=(cfg.epochs - first + 1) * steps_per_epoch, desc=variant.label,
             disable=not progress or jax.process_index() != 0, unit="step", leave=False)
  bytes_per_step = float(_host(sj.sync_stats(state.opt_state).bytes_sent)[0])
  for epoch in range(first, cfg.epochs + 1):
    losses, accs = [], []
    for batch in input_pipeline.train_batches(ds, cfg.batch_size, seed=cfg.seed, epoch=epoch):
      start = time.perf_counter()
      state, metrics = train(state, sj.data_parallel.shard_rows(batch, mesh, cfg.axis_name))
      # Waiting for every step also guards the CPU multi-device rendezvous deadlock.
      jax.block_until_ready(state)
      times.append(time.perf_counter() - start)
      stats = sj.sync_stats(state.opt_state)
      bytes_per_step = float(_host(stats.bytes_sent)[0])
      sent += bytes_per_step
      losses.append(float(_host(metrics.loss)))
      accs.append(float(_host(metrics.accuracy)))
      bar.update()
      bar.set_postfix(epoch=epoch, loss=f"{losses[-1]:.3f}")
    test_loss, test_acc = evaluate_model(evaluate, state.params, ds, mesh, cfg)
    history.append({"epoch": epoch, "train_loss": float(np.mean(losses)),
                    "train_accuracy": float(np.mean(accs)), "test_loss": float(test_loss),
                    "test_accuracy": float(test_acc), "bytes_sent": sent,
                    "residual_norm": float(np.mean(_host(stats.residual_norm)))})
    if mgr:
      checkpoint.save(mgr, epoch, state, history)
  bar.close()
  if mgr:
    mgr.close()
  # The first step includes compilation.
  time_per_step = float(np.median(times[1:] if len(times) > 1 else times or [np.nan]))
  return RunResult(variant.label, history, num_params, bytes_per_step, time_per_step, state)
