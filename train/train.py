"""Data-parallel training with a gradient sync from spardl_jax (Flax + optax + shard_map).

The train step runs inside ``jax.shard_map`` over the data axis. Each device computes the
gradient of its own batch slice and the optimizer's first transformation synchronizes it.
Two details make the sync really sparse:

* **the gradient trap**: the parameters arrive replicated, and ``jax.grad`` of a replicated
  input inside ``shard_map`` returns an already ``psum``-ed gradient (a hidden dense
  all-reduce). The step casts them to *varying* first (``jax.lax.pcast``), so the gradient
  stays local; ``tests/trainer/test_train.py`` checks the compiled step has no gradient-sized
  all-reduce.
* the synchronized gradient is bit-identical on all devices but typed *varying*, so the step
  uses ``check_vma=False`` to return the new parameters replicated.
"""

from __future__ import annotations

import functools
import json
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

import models
import spardl_jax as sj
from train import data, input_pipeline
from train.config import TrainConfig, Variant
from train.loop import Loop, Position, host
from train.mesh import ISLAND_AXIS, batch_axes, param_specs, replica_axis
from train.optimizer import make_optimizer, variant_tuning

log = logging.getLogger("train")


@flax.struct.dataclass
class TrainState:
  """``step`` () int32; ``params`` and ``model_state`` (batch-norm statistics; ``{}`` for
  models without) replicated; ``opt_state`` with per-device residuals."""

  step: jax.Array
  params: Any
  model_state: Any
  opt_state: Any


class StepMetrics(NamedTuple):
  """One train step's global mean loss and metric (accuracy, or MAE for regression) over
  its batch (float32 scalars), and the bytes each device sent in its gradient sync (``(P,)``
  float32, one per device, read from the sync's statistics without communication); kept on
  the device until the loop fetches a whole log interval at once."""

  loss: jax.Array
  metric: jax.Array
  bytes_sent: jax.Array


def check_model_data(model: str, dataset: str) -> None:
  """Raises a ValueError naming the datasets ``model`` can read, if ``dataset`` is not one."""
  spec = models.spec(model)
  if data.kind(dataset) not in spec.inputs:
    fits = sorted(d for d in data.DATASETS if data.kind(d) in spec.inputs)
    raise ValueError(f"--model {model} reads {'/'.join(spec.inputs)} data; --dataset must "
                     f"be one of {fits}, got {dataset!r}.")


def data_request(cfg: TrainConfig) -> data.Request:
  """What ``cfg.model`` needs from the dataset: objective, vocabulary size, sequence length."""
  spec = models.spec(cfg.model)
  model = models.create(cfg.model, cfg.model_size)
  return data.Request(
      objective=spec.objective, vocab_size=getattr(model, "vocab_size", None),
      seq_len=cfg.seq_len or spec.example[0][0], image_size=cfg.image_size,
      data_dir=cfg.data_dir, seed=cfg.seed)


def create_train_state(rng: jax.Array, model: nn.Module, tx: optax.GradientTransformation,
                       example_x: np.ndarray, mesh: jax.sharding.Mesh, axis_name: str,
                       specs=None) -> tuple[TrainState, TrainState]:
  """Initial state (params replicated, or sharded by ``specs`` over the mesh's other axes;
  residuals one row per device) and its PartitionSpecs for the train step's ``shard_map``
  over the data axis."""
  variables = dict(jax.jit(model.init)(rng, jnp.asarray(example_x[:1])))
  params = variables.pop("params")
  replicated = jax.sharding.NamedSharding(mesh, PartitionSpec())
  step, model_state = jax.device_put((jnp.zeros((), jnp.int32), variables), replicated)
  params = (jax.device_put(params, replicated) if specs is None else jax.tree.map(
      lambda p, spec: jax.device_put(p, jax.sharding.NamedSharding(mesh, spec)), params, specs))
  rows = replica_axis(mesh, axis_name)  # the state's rows: over the islands, if any
  opt_state = sj.init_opt_state(tx, params, mesh, axis_name=rows, param_specs=specs)
  state = TrainState(step=step, params=params, model_state=model_state, opt_state=opt_state)
  over_data = functools.partial(jax.tree.map, lambda _: PartitionSpec())
  return state, TrainState(
      step=PartitionSpec(), params=over_data(params), model_state=over_data(model_state),
      opt_state=sj.opt_state_specs(tx, params, mesh, axis_name=rows, param_specs=specs,
                                   axis_names=manual_axes(mesh, axis_name)))


def manual_axes(mesh: jax.sharding.Mesh, axis_name: str) -> set[str]:
  """The axes the steps' ``shard_map`` binds: the batch's (the rest are the compiler's)."""
  axes = batch_axes(mesh, axis_name)
  return {axes} if isinstance(axes, str) else set(axes)


def _loss_terms(task: str, out: jax.Array, y: jax.Array):
  """Per-target loss and metric: cross-entropy and correctness, or squared and absolute
  error for regression (``out`` ``(b, 1)`` for scalar targets ``y`` ``(b,)``, else shaped
  like ``y``)."""
  if task == "regress":
    err = (out[..., 0] if out.ndim == y.ndim + 1 else out) - y
    return err ** 2, jnp.abs(err)
  losses = optax.softmax_cross_entropy_with_integer_labels(out, y)
  return losses, (jnp.argmax(out, -1) == y).astype(jnp.float32)


def _apply(model: nn.Module, state: TrainState, params, x, *, train: bool, rngs=None):
  """The model's output and, in training, its updated ``model_state`` (batch norm)."""
  variables = {"params": params, **state.model_state}
  if train and state.model_state:
    return model.apply(variables, x, train=True, rngs=rngs, mutable=list(state.model_state))
  return model.apply(variables, x, train=train, rngs=rngs), state.model_state


def train_step(state: TrainState, batch, *, model: nn.Module, tx: optax.GradientTransformation,
               axis_name, task: str, seed: int, link: str) -> tuple[TrainState, StepMetrics]:
  """One step on this device's slice ``batch = (x, y, w)``; inside shard_map over the
  batch's ``axis_name`` (an axis, or the island and data axes).

  The loss is the global weighted mean, so devices whose slices hold more scored targets
  (masked tokens, non-padding) weigh more: each device's loss is its weighted sum times
  ``P / total weight``, and the sync averages over the ``P`` devices. The bytes are what the
  syncs over the ``link`` axis sent (on an islands mesh: across the islands, the slow link).
  """
  x, y, w = batch
  size = jax.lax.axis_size(axis_name)
  total = jnp.maximum(jax.lax.psum(jnp.sum(w), axis_name), 1.0)
  # Dropout differs per step and device, and is a function of both (a resume repeats it).
  rngs = {"dropout": jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), state.step),
                                        jax.lax.axis_index(axis_name))}

  def loss_fn(params):
    out, model_state = _apply(model, state, params, x, train=True, rngs=rngs)
    losses, metric = _loss_terms(task, out, y)
    return jnp.sum(losses * w) * size / total, (jnp.sum(metric * w), model_state)

  # Varying params keep the gradient local (see the module docstring); in an outer loop
  # they are this device's replica.
  # With a look-ahead, the point one step ahead of that (sj.gradient_point).
  point = sj.gradient_point(tx, state.opt_state, state.params)
  local_params = jax.lax.pcast(point, axis_name, to="varying")
  (loss, (metric, model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(local_params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  # Batch-norm statistics are averaged so they stay replicated (a few values per channel).
  model_state = jax.lax.pmean(model_state, axis_name)
  sums = jax.lax.psum(jnp.stack([loss / size, metric / total]), axis_name)
  return (state.replace(step=state.step + 1, params=params, model_state=model_state,
                        opt_state=opt_state),
          StepMetrics(loss=sums[0], metric=sums[1], bytes_sent=sum(
              s.bytes_sent for s in sj.sync_stats(opt_state, by_part=True, axis=link).values())))


def eval_step(state: TrainState, batch, *, model: nn.Module, axis_name: str,
              task: str) -> jax.Array:
  """``(3,)`` float32 sums over the global batch: loss, metric, weight (padding excluded)."""
  x, y, w = batch
  out, _ = _apply(model, state, state.params, x, train=False)
  losses, metric = _loss_terms(task, out, y)
  return jax.lax.psum(jnp.stack([jnp.sum(losses * w), jnp.sum(metric * w), jnp.sum(w)]),
                      axis_name)


def compile_steps(model: nn.Module, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh,
                  specs: TrainState, axis_name: str, *, task: str = "classify", seed: int = 0,
                  shardings: TrainState | None = None):
  """``(train, evaluate)``: the jitted shard_map programs of the two steps. ``shardings``
  (the state's) pin the new state's layout: on a mesh of several axes the compiler would
  otherwise pick one for what the step leaves to it (a replicated bias, say)."""
  data = batch_axes(mesh, axis_name)
  rows = PartitionSpec(data)
  # Over the data axes only: on a mesh of several axes the compiler shards the model's
  # computation over the others (a partial-auto shard_map), and the sync its own.
  manual = manual_axes(mesh, axis_name)
  train = jax.jit(jax.shard_map(
      functools.partial(train_step, model=model, tx=tx, axis_name=data, task=task,
                        seed=seed, link=replica_axis(mesh, axis_name)),
      mesh=mesh, in_specs=(specs, rows), axis_names=manual,
      out_specs=(specs, StepMetrics(PartitionSpec(), PartitionSpec(), rows)), check_vma=False),
      out_shardings=None if shardings is None else (shardings, None))
  evaluate = jax.jit(jax.shard_map(
      functools.partial(eval_step, model=model, axis_name=data, task=task), mesh=mesh,
      # Without the check: scans (LSTMs) start from unvarying zero carries on varying data.
      in_specs=(specs, rows), out_specs=PartitionSpec(), axis_names=manual, check_vma=False))
  return train, evaluate


class RunResult(NamedTuple):
  """What one variant's training produced.

  Attributes:
    variant: the label.
    metric: the dataset's metric, ``"accuracy"`` or ``"mae"`` (regression).
    history: one dict per epoch: ``steps`` (taken so far), ``train_loss``, ``test_loss``,
      ``train_<metric>``,
      ``test_<metric>``, ``bytes_sent`` (cumulative per device), ``train_seconds``
      (cumulative wall time of the train steps and their input, the compilation and the
      evaluations left out: what time to accuracy counts), ``residual_norm``, ``density``
      (of the level the epoch's last sync used: 1 in a dense warm-up, ``density="auto"``'s
      pick at these devices).
    num_params: parameters (float entries synchronized per step).
    bytes_per_step: bytes each device sent per step, the mean over the run (an outer loop's
      syncs spread over its steps; a dense warm-up counted).
    time_per_step: median wall seconds of a train step, compilation excluded (see
      :class:`_Loop` for how steps are timed).
    state: the final train state.
    tuning: the tuning the variant trained with, its own keys and the recipe's (by key).
  """

  variant: str
  metric: str
  history: list
  num_params: int
  bytes_per_step: float
  time_per_step: float
  state: TrainState
  tuning: dict | None = None


def evaluate_model(evaluate, state: TrainState, ds: data.Dataset, mesh,
                   cfg: TrainConfig) -> tuple[float, float]:
  """Test-set mean loss and metric."""
  total = np.zeros(3)
  data = batch_axes(mesh, cfg.axis_name)
  for batch in input_pipeline.eval_batches(ds.test, cfg.batch_size, mesh, data,
                                           steps=cfg.eval_steps):
    total += host(evaluate(state, sj.distributed.shard_rows(batch, mesh, data,
                                                               local=True)))
  return total[0] / total[2], total[1] / total[2]


class _Run(NamedTuple):
  """What :func:`_setup` fixes for a run."""

  model: nn.Module
  steps: int  # per epoch
  tx: optax.GradientTransformation
  example: np.ndarray  # one input
  params: Any  # the parameters' shapes and dtypes, placed by ``specs`` on the mesh
  specs: Any  # the parameters' specs over the mesh's other axes; None on a one-axis mesh


def _setup(cfg: TrainConfig, variant: Variant, ds: data.Dataset,
           mesh: jax.sharding.Mesh) -> _Run:
  """A run's model, optimizer and parameter layout, its sizes checked."""
  if cfg.batch_size % mesh.size:
    raise ValueError(f"--batch-size ({cfg.batch_size}) must be a multiple of --devices "
                     f"({mesh.size}).")
  check_model_data(cfg.model, ds.name)
  model = models.create(cfg.model, cfg.model_size, **ds.info)
  steps = input_pipeline.steps_per_epoch(ds.train, cfg.batch_size, cfg.steps_per_epoch)
  if steps < 1:
    raise ValueError(f"--batch-size ({cfg.batch_size}) is larger than the training set "
                     f"({len(ds.train)} examples).")
  example = ds.train.take(np.arange(1))[0]
  abstract = jax.eval_shape(model.init, jax.random.key(0), jnp.asarray(example[:1]))["params"]
  specs = param_specs(abstract, mesh, cfg.axis_name)
  islands = ISLAND_AXIS in mesh.axis_names
  params = jax.tree.map(
      lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                           sharding=jax.sharding.NamedSharding(mesh, spec)),
      abstract, specs or jax.tree.map(lambda _: PartitionSpec(), abstract))
  tx = make_optimizer(cfg, variant, steps_per_epoch=steps, specs=specs,
                      devices=mesh.shape[cfg.axis_name] * (mesh.shape[ISLAND_AXIS] if islands
                                                           else 1), islands=islands)
  return _Run(model, steps, tx, example, params, specs)


# The flags a checkpoint's arrays depend on: resuming with another value would train another
# run on them. More --epochs continue the same run (except under a cosine schedule, whose
# decay they set), and another device count folds the residuals (train/checkpoint.py).
_RUN_FLAGS = {"model": "--model", "model_size": "--model-size", "dataset": "--dataset",
              "batch_size": "--batch-size", "lr": "--lr", "momentum": "--momentum",
              "lr_schedule": "--lr-schedule", "recipe": "--recipe",
              "optimizer": "--optimizer", "weight_decay": "--weight-decay", "seed": "--seed",
              "weight_decay_on": "--weight-decay-on", "adam_b2": "--adam-b2",
              "adam_lr": "--adam-lr",
              "grad_clip": "--grad-clip", "lr_warmup": "--lr-warmup", "lr_final": "--lr-final",
              "seq_len": "--seq-len", "image_size": "--image-size", "islands": "--islands"}


def run_record(cfg: TrainConfig, variant: Variant, steps_per_epoch: int) -> dict:
  """What a checkpoint of this run was trained with, by flag (JSON types, as the progress
  record stores it): :data:`_RUN_FLAGS`, the steps an epoch, the method, its options and
  the tuning it trains with (the recipe's included)."""
  record = {flag: getattr(cfg, field) for field, flag in _RUN_FLAGS.items()}
  record["--steps-per-epoch (steps an epoch)"] = steps_per_epoch
  if cfg.lr_schedule == "cosine":
    record["--epochs"] = cfg.epochs
  record["method"] = variant.method
  record.update({f"option {k}": v for k, v in variant.options.items()})
  tuning = variant_tuning(cfg, variant, steps_per_epoch=steps_per_epoch)
  record.update({f"tuning {k}": v for k, v in tuning.given().items()})
  return json.loads(json.dumps(record))


def check_variant(cfg: TrainConfig, variant: Variant, ds: data.Dataset,
                  mesh: jax.sharding.Mesh, *, checkpoint_dir: str | None = None) -> None:
  """Everything about ``variant`` that could fail during its run, checked before any run
  starts: its optimizer is built and its sync traced on ``mesh`` (shapes only: nothing is
  compiled or allocated), so options that fit only some device counts (``teams``) fail
  now, and the newest checkpoint in ``checkpoint_dir`` must have been written with the same
  flags (:func:`train.checkpoint.check_same_run`)."""
  from train import checkpoint

  run = _setup(cfg, variant, ds, mesh)
  tx, params, layout = run.tx, run.params, run.specs
  rows, manual = replica_axis(mesh, cfg.axis_name), manual_axes(mesh, cfg.axis_name)
  specs = sj.opt_state_specs(tx, params, mesh, axis_name=rows, param_specs=layout,
                             axis_names=manual)
  opt_state = jax.eval_shape(
      lambda p: sj.init_opt_state(tx, p, mesh, axis_name=rows, param_specs=layout),
      params)
  update = jax.shard_map(lambda g, s, p: tx.update(g, s, p), mesh=mesh,
                         in_specs=(PartitionSpec(), specs, PartitionSpec()),
                         out_specs=(PartitionSpec(), specs), axis_names=manual,
                         check_vma=False)
  jax.eval_shape(update, params, opt_state, params)
  if checkpoint_dir:
    checkpoint.check_newest(checkpoint_dir, run_record(cfg, variant, run.steps))


def train_and_evaluate(cfg: TrainConfig, variant: Variant, ds: data.Dataset,
                       mesh: jax.sharding.Mesh, *, progress: bool = True,
                       nested: bool = False,
                       checkpoint_dir: str | None = None) -> RunResult:
  """Trains ``cfg.model`` on ``ds`` with ``variant``'s gradient sync for ``cfg.epochs``.

  With ``checkpoint_dir``, the state is saved after every epoch (and every
  ``cfg.checkpoint_every`` steps inside one), numbered by the train steps taken, with a JSON
  record of the progress: the epoch history and, inside an epoch, the Grain iterator's state
  and the metrics of the steps taken. A run that finds a checkpoint there resumes from it
  (each epoch's data order depends only on the seed and the epoch, and the iterator resumes
  at its step, so the resumed run is bit-identical to an uninterrupted one). A checkpoint
  written on another number of devices is restored with its residual mass redistributed
  (:func:`train.checkpoint.restore_latest`).

  ``progress``: a bar of the steps on a terminal (``nested``: on the second line, under a
  sweep's bar of runs); off a terminal, or False, only the compile and epoch lines.
  """
  from train import checkpoint

  model, steps, tx, example, _, layout = _setup(cfg, variant, ds, mesh)
  link = replica_axis(mesh, cfg.axis_name)  # the bytes counted: over it (the slow link)
  state, specs = create_train_state(jax.random.key(cfg.seed), model, tx, example, mesh,
                                    cfg.axis_name, layout)
  train, evaluate = compile_steps(model, tx, mesh, specs, cfg.axis_name, task=ds.task,
                                  seed=cfg.seed,
                                  shardings=jax.tree.map(lambda x: x.sharding, state))
  num_params = models.count(state.params)
  mgr = checkpoint.manager(checkpoint_dir) if checkpoint_dir else None
  restored = mgr and checkpoint.restore_latest(mgr, state)
  at, history = Position.start(1), []
  run = run_record(cfg, variant, steps)
  if restored:
    step, state, record = restored
    checkpoint.check_same_run(record, run, step, checkpoint_dir)
    history, at = record["history"], Position(**record["position"])
    log.info("%s: resumed from %s at epoch %d, step %d of %d", variant.label, checkpoint_dir,
             at.epoch, at.done, steps)
    if at.done >= steps:  # an epoch-end checkpoint: start the next epoch
      at = Position.start(at.epoch + 1)
  loop = Loop(variant.label, total=(cfg.epochs - at.epoch + 1) * steps - at.done,
               log_every=cfg.log_every, progress=progress, nested=nested)
  sent = history[-1]["bytes_sent"] if history else 0.0
  clock = history[-1].get("train_seconds", 0.0) if history else 0.0
  for epoch in range(at.epoch, cfg.epochs + 1):
    resume = epoch == at.epoch and at.done > 0
    epoch_start, compiled_before = time.perf_counter(), loop.compile_seconds
    loop.start_epoch(at.rows if resume else [])
    batches = input_pipeline.train_batches(ds.train, cfg.batch_size, mesh,
                                           batch_axes(mesh, cfg.axis_name),
                                           seed=cfg.seed, epoch=epoch,
                                           steps=cfg.steps_per_epoch,
                                           workers=cfg.data_workers,
                                           state=at.iterator if resume else None)
    for done, batch in enumerate(batches, start=at.done + 1 if resume else 1):
      batch = sj.distributed.shard_rows(batch, mesh, batch_axes(mesh, cfg.axis_name),
                                        local=True)
      if loop.step_fn is None:
        loop.compile(train, state, batch)
      state = loop.step(state, batch, epoch)
      step = (epoch - 1) * steps + done
      if mgr and cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and done < steps:
        position = Position(epoch, done, loop.rows_so_far(epoch).tolist(),
                             batches.get_state())
        checkpoint.save(mgr, step, state, {"history": history, "run": run,
                                           "position": position._asdict()})
        loop.restart_clock()  # the save is not a step's time
    epoch_metrics = loop.fetch(epoch)  # (steps, 3): loss, metric, bytes per step
    clock += time.perf_counter() - epoch_start - (loop.compile_seconds - compiled_before)
    sent += float(epoch_metrics[:, 2].sum())
    test_loss, test_metric = evaluate_model(evaluate, state, ds, mesh, cfg)
    parts = list(sj.sync_stats(state.opt_state, by_part=True, axis=link).values())
    history.append({"epoch": epoch, "steps": epoch * steps,
                    "train_loss": float(epoch_metrics[:, 0].mean()),
                    f"train_{ds.metric}": float(epoch_metrics[:, 1].mean()),
                    "test_loss": float(test_loss), f"test_{ds.metric}": float(test_metric),
                    "bytes_sent": sent, "train_seconds": clock,
                    "residual_norm": float(np.sqrt(sum(np.mean(host(s.residual_norm)) ** 2
                                                       for s in parts))),
                    "density": float(host(parts[0].density)[0]),
                    **_inside(state.opt_state, mesh, cfg.axis_name)})
    loop.log(f"epoch {epoch}/{cfg.epochs}: train loss {history[-1]['train_loss']:.4f}, "
             f"test {ds.metric} {test_metric:.4f}")
    if mgr:
      checkpoint.save(mgr, epoch * steps, state, {
          "history": history, "run": run,
          "position": Position(epoch, steps, [], None)._asdict()})
  loop.close()
  if mgr:
    mgr.close()
  bytes_per_step = (history[-1]["bytes_sent"] / history[-1]["steps"] if history else
                    float(sum(host(s.bytes_sent)[0] for s in sj.sync_stats(
                        state.opt_state, by_part=True, axis=link).values())))
  time_per_step = float(np.median(loop.times)) if loop.times else float("nan")
  return RunResult(variant.label, ds.metric, history, num_params, bytes_per_step,
                   time_per_step, state,
                   variant_tuning(cfg, variant, steps_per_epoch=steps).given())


def _inside(opt_state, mesh: jax.sharding.Mesh, axis_name: str) -> dict:
  """On an islands mesh, ``bytes_inside_per_step``: what each device sent inside its island
  at the last step (an island's own syncs, over ``axis_name``); nothing elsewhere."""
  if ISLAND_AXIS not in mesh.axis_names:
    return {}
  inside = sj.sync_stats(opt_state, by_part=True, axis=axis_name).values()
  return {"bytes_inside_per_step": float(sum(host(s.bytes_sent)[0] for s in inside))}
