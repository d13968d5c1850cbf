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
import math
import sys
import time
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec
from tqdm import tqdm

import models
import spardl_jax as sj
from train import data, input_pipeline
from train.config import TrainConfig, Tuning, Variant, recipe_tuning

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


def simulate_devices(devices: int) -> None:
  """Asks for ``devices`` simulated CPU devices, if the backend has not started yet.

  Only the CPU backend reads the setting; once it has started (an embedding program, a
  test session) the call does nothing and :func:`make_mesh` checks what is there.
  """
  try:
    jax.config.update("jax_num_cpu_devices", max(devices, 1))
  except RuntimeError:
    pass


MODEL_AXIS = "model"  # the --mesh axis the trainer shards parameters over


def make_mesh(devices: int | None = None, axis_name: str = "data", *,
              axes: tuple[tuple[str, int], ...] = ()) -> jax.sharding.Mesh:
  """A 1-D mesh over the first ``devices`` devices of the default backend (all of them,
  across every process of a ``jax.distributed`` job, when None); or, with ``axes`` (``--mesh``
  pairs of axis and size, ``axis_name`` among them), a mesh of those axes over as many
  devices, its axes ``Auto`` so that the model code runs unchanged on sharded parameters."""
  available = jax.devices()
  if axes:
    names, sizes = zip(*axes)
    total = math.prod(sizes)
    if axis_name not in names:
      raise ValueError(f"--mesh must have the data axis {axis_name!r}, got axes {names}.")
    unknown = [n for n in names if n not in (axis_name, MODEL_AXIS)]
    if unknown:  # the trainer gives no other axis a meaning: it would shard as model does
      raise ValueError(f"--mesh knows the axes {axis_name!r} (the batch) and {MODEL_AXIS!r} "
                       f"(parameters sharded FSDP-style); got {unknown[0]!r}.")
    if devices is not None and devices != total:
      raise ValueError(f"--devices {devices} and --mesh ({total} devices) disagree; give one.")
    if total > len(available):
      raise ValueError(f"--mesh needs {total} devices, but {len(available)} are available "
                       f"on {available[0].platform}.")
    return jax.make_mesh(sizes, names, devices=available[:total],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(names))
  devices = len(available) if devices is None else devices
  if not 1 <= devices <= len(available):
    raise ValueError(f"--devices must be in [1, {len(available)}] (devices available on "
                     f"{available[0].platform}), got {devices}.")
  return jax.make_mesh((devices,), (axis_name,), devices=available[:devices],
                       axis_types=(jax.sharding.AxisType.Explicit,))


def param_specs(params, mesh: jax.sharding.Mesh, axis_name: str):
  """FSDP-style ``PartitionSpec`` s of ``params`` over ``mesh``'s axes besides the data axis:
  each parameter of at least 1,024 entries is sharded over all of them together along its
  largest dimension they divide; the rest (biases, norms) stay replicated. None on a
  one-axis mesh."""
  others = tuple(a for a in mesh.axis_names if a != axis_name)
  if not others:
    return None
  size = math.prod(mesh.shape[a] for a in others)
  axis = others if len(others) > 1 else others[0]

  def spec(x):
    dims = [d for d in np.argsort(x.shape)[::-1] if x.shape[d] % size == 0]
    if x.size < 1024 or not dims:
      return PartitionSpec()
    return PartitionSpec(*(axis if d == dims[0] else None for d in range(len(x.shape))))

  return jax.tree.map(spec, params)


def make_optimizer(cfg: TrainConfig, variant: Variant, *, steps_per_epoch: int | None = None,
                   specs=None) -> optax.GradientTransformation:
  """The variant's gradient sync followed by SGD with momentum or AdamW (``cfg.optimizer``).

  The sync comes first, so the optimizer sees the synchronized gradient and its state stays
  replicated. The variant's tuning (:class:`train.config.Tuning`; for a sparse method, what
  it leaves out comes from the recipe ``cfg.recipe``, whose lengths in epochs need
  ``steps_per_epoch``) sets:

  * the sync's dense warm-up (``warmup``), DGC density warm-up (``ramp``), momentum
    correction (``momentum``, ``masking``) and local clipping (``clip``);
  * the optimizer's momentum (``opt_momentum``: SGD's momentum or AdamW's ``b1``). For SGD
    without an explicit ``lr`` the rate is rescaled to keep ``lr / (1 - momentum)``, the
    step size a steady gradient reaches, equal to ``--lr``'s with ``--momentum``: lowering
    the momentum then changes only how much past gradient the optimizer replays, which is
    what a residual (itself a store of past gradient) wants;
  * with momentum correction the momentum lives before the sync, so SGD after it has none
    and AdamW's ``b1`` is 0;
  * ``freeze`` (AdamW): the second moment stops after that many steps
    (:func:`spardl_jax.adam.scale_by_frozen_adam`), decoupled weight decay as AdamW's.
  * ``synced`` (AdamW): Adam around the sync (:func:`spardl_jax.adam.scale_by_synced_adam`):
    ``momentum``, the sync averages Adam's first moment (1-bit Adam's compression stage);
    ``preconditioned``, the gradient divided by Adam's frozen ``sqrt(v) + eps``
    (:func:`spardl_jax.synced_adamw`). The second moment trains on the dense warm-up's mean
    gradient, then stays frozen or, with ``second_moment=sent``, trains where the sync
    delivers;
  * ``dense_leaves``: leaves the sync averages densely every step, outside the method
    (``"vectors"``: biases and norm scales; ``N``: leaves of fewer than N entries);
  * ``delay=1``: each step syncs the gradient of the step before, so the transfer may run
    during the next step's compute (``sync_gradients``' ``delay``); with ``lookahead=F`` the
    step takes its gradient ahead, by the fraction F of each device's estimate of the sync
    in flight (:func:`spardl_jax.weight_prediction`'s ``scale``);
  * ``balance=leaves``: each leaf scaled to the vector's size before the method selects,
    so that a global top-k does not starve the leaves of small gradients
    (``sync_gradients``' ``balance``);
  * ``decay``: SparseLoCo's decayed error feedback (``sync_gradients``' ``residual_decay``);
    with ``outer=H:outer_momentum=0`` it is SparseLoCo's outer loop;
  * ``sign=1``: DeMo (:func:`spardl_jax.demo`) in place of the optimizer: the sync's
    residual, decayed by ``decay`` (default 0.999), is each device's momentum, and the
    update is the sign of the synced result with the decoupled weight decay.

  ``cfg.lr_schedule='cosine'`` decays the rate to 0 over the run. ``specs`` are the
  parameters' specs on a mesh of several axes (:func:`param_specs`), for the sync.

  With an outer loop (``outer=H``, or ``--outer-every H``) the optimizer runs alone on each
  device for ``H`` steps, and the sync averages the parameter change for an outer Nesterov
  step (:func:`spardl_jax.diloco`).
  """
  tuning = variant_tuning(cfg, variant, steps_per_epoch=steps_per_epoch)
  corrected = tuning.momentum is not None
  default_momentum = cfg.momentum if cfg.optimizer == "sgd" else 0.9
  momentum = 0.0 if corrected else (default_momentum if tuning.opt_momentum is None
                                    else tuning.opt_momentum)
  lr = cfg.lr if tuning.lr is None else tuning.lr
  if cfg.optimizer == "sgd" and tuning.lr is None and tuning.opt_momentum is not None:
    lr = cfg.lr * (1 - momentum) / (1 - cfg.momentum)
  lr = learning_rate(cfg, lr, steps_per_epoch)
  # nanoGPT's configure_optimizers: no decay on biases and norm scales.
  decay_mask = (None if cfg.weight_decay_on == "all"
                else lambda params: jax.tree.map(lambda x: x.ndim >= 2, params))
  if cfg.optimizer == "sgd":
    opt = optax.sgd(lr, momentum=momentum or None)
  elif cfg.optimizer == "adamw" and tuning.freeze:
    opt = optax.chain(sj.adam.scale_by_frozen_adam(freeze_step=tuning.freeze, b1=momentum,
                                              b2=cfg.adam_b2),
                      optax.add_decayed_weights(cfg.weight_decay, decay_mask),
                      optax.scale_by_learning_rate(lr))
  elif cfg.optimizer == "adamw":
    opt = optax.adamw(lr, b1=momentum, b2=cfg.adam_b2, weight_decay=cfg.weight_decay,
                      mask=decay_mask)
  else:
    raise ValueError(f"--optimizer must be 'sgd' or 'adamw', got {cfg.optimizer!r}.")
  # Dense training clips the mean gradient (after the sync), as nanoGPT does; where the
  # optimizer is around the sync or inside an outer loop, each device clips its own. No
  # clipping leaves the optimizer's structure (and its checkpoints) as it was.
  def clipped(*txs):
    if cfg.grad_clip is None:
      return txs[0] if len(txs) == 1 else optax.chain(*txs)
    return optax.chain(*txs[:-1], optax.clip_by_global_norm(cfg.grad_clip), txs[-1])
  options = dict(variant.options)
  warmup = tuning.warmup or 0
  if tuning.ramp:
    options["density"] = sj.density_warmup(options["density"], steps=tuning.ramp,
                                           at=warmup)
  sync_options = dict(axis_name=cfg.axis_name, clip_norm=tuning.clip,
                      residual_decay=tuning.decay, param_specs=specs, **options)
  if tuning.dense_leaves:
    sync_options["dense_leaves"] = (tuning.dense_leaves if tuning.dense_leaves == "vectors"
                                    else int(tuning.dense_leaves))
  if tuning.delay:
    sync_options["delay"] = tuning.delay
  if tuning.balance:
    sync_options["balance"] = tuning.balance
  if tuning.sign:  # decay= is DeMo's momentum (sj.demo's default where not given)
    decay = sync_options.pop("residual_decay")
    return clipped(sj.demo(lr, method=variant.method, weight_decay=cfg.weight_decay,
                           mask=decay_mask, warmup_steps=warmup, **sync_options,
                           **({} if decay is None else {"decay": decay})))
  if tuning.synced:
    # The density, wire and dense leaves are the spec's, the flags' or the recipe's
    # (RECIPE_OPTIONS, RECIPES): synced_adamw's own defaults never fill them in, so that
    # --recipe paper with synced= keeps SparDL's wire and every leaf through the method.
    if variant.method == "spardl":
      sync_options.setdefault("wire", sj.collectives.SparDLConfig.wire)
    return clipped(sj.synced_adamw(
        lr, warmup_steps=warmup, method=variant.method, b1=momentum, b2=cfg.adam_b2,
        weight_decay=cfg.weight_decay, mask=decay_mask, sends=tuning.synced,
        second_moment=tuning.second_moment or "frozen",
        **{"dense_leaves": None, **sync_options}))
  sync = sj.sync_gradients(variant.method, warmup_steps=warmup, momentum=tuning.momentum,
                           momentum_masking=tuning.masking != 0, **sync_options)
  if tuning.outer:
    outer = optax.sgd(tuning.outer_lr, momentum=tuning.outer_momentum or None,
                      nesterov=bool(tuning.outer_momentum))
    return sj.diloco(clipped(opt), sync, every=tuning.outer, outer=outer)
  if tuning.lookahead:
    return sj.weight_prediction(sync, clipped(opt), scale=tuning.lookahead)
  return clipped(sync, opt)


def learning_rate(cfg: TrainConfig, peak: float,
                  steps_per_epoch: int | None) -> optax.ScalarOrSchedule:
  """``peak``, or under ``cfg.lr_schedule='cosine'`` a linear warm-up from 0 over
  ``cfg.lr_warmup`` steps and a cosine decay to ``cfg.lr_final * peak`` at the run's end
  (nanoGPT's ``get_lr``)."""
  if cfg.lr_schedule == "constant":
    return peak
  if cfg.lr_schedule != "cosine":
    raise ValueError(f"--lr-schedule must be 'constant' or 'cosine', got {cfg.lr_schedule!r}.")
  if not steps_per_epoch:
    raise ValueError("make_optimizer: lr_schedule='cosine' needs steps_per_epoch.")
  total = cfg.epochs * steps_per_epoch
  if not 0 <= cfg.lr_warmup < total:
    raise ValueError(f"--lr-warmup must be in [0, {total}) (the run's steps), got "
                     f"{cfg.lr_warmup}.")
  if cfg.lr_warmup:
    return optax.warmup_cosine_decay_schedule(0.0, peak, cfg.lr_warmup, total,
                                              end_value=cfg.lr_final * peak)
  return optax.cosine_decay_schedule(peak, total, alpha=cfg.lr_final)


def variant_tuning(cfg: TrainConfig, variant: Variant, *,
                   steps_per_epoch: int | None = None) -> Tuning:
  """The :class:`~train.config.Tuning` ``variant`` trains with: its own keys, and for a
  sparse method the recipe ``cfg.recipe`` for what they leave out.

  Raises:
    ValueError: for a key that cannot act here (``freeze`` without AdamW, ``masking``
      without ``momentum``, ``ramp`` for a method without a density), rather than ignore it.
  """
  tuning = variant.tuning
  every = cfg.outer_every if tuning.outer is None else tuning.outer
  if every:
    tuning = tuning.over(Tuning(outer=every, outer_lr=cfg.outer_lr,
                                outer_momentum=cfg.outer_momentum))
  elif tuning.outer_lr is not None or tuning.outer_momentum is not None:
    raise ValueError("outer_lr and outer_momentum (the outer loop's step) need outer=H "
                     "in the same spec, or --outer-every H.")
  recipe = recipe_tuning(cfg.recipe, optimizer=cfg.optimizer, steps_per_epoch=steps_per_epoch)
  if sj.methods.is_sparse(variant.method) and not every:  # the recipe fills in the rest
    if tuning.momentum is not None or tuning.sign:  # a momentum in place of Adam's around
      recipe = recipe._replace(synced=None, second_moment=None)
    tuning = tuning.over(recipe)
  elif tuning.synced and tuning.second_moment is None:
    # Adam around any other sync (PowerSGD) trains v as the recipe does: v frozen after a
    # short warm-up is one sample of the mean gradient's square, near 0 for some
    # coordinates, whose steps then grow far beyond the learning rate (a loss of 577
    # after two steps with a one-step warm-up).
    tuning = tuning._replace(second_moment=recipe.second_moment)
  if tuning.freeze is not None and cfg.optimizer != "adamw":
    raise ValueError(f"freeze (Adam's second moment frozen) needs --optimizer "
                     f"adamw, got --optimizer {cfg.optimizer}.")
  if tuning.masking is not None and tuning.momentum is None:
    raise ValueError("masking (DGC's momentum factor masking) needs momentum=M "
                     "(DGC's momentum correction) in the same spec.")
  if tuning.synced:
    if cfg.optimizer != "adamw":
      raise ValueError(f"synced (Adam around the sync) needs --optimizer adamw, got "
                       f"--optimizer {cfg.optimizer}.")
    if (not tuning.warmup or tuning.momentum is not None or tuning.outer
        or tuning.freeze not in (None, tuning.warmup)):
      raise ValueError("synced trains Adam's second moment on the mean gradient of a dense "
                       "warm-up and freezes it there: it needs warmup=N (N >= 1), and takes "
                       "no momentum=M (Adam's first moment is the momentum), no outer=H and "
                       "no other freeze.")
  if tuning.second_moment and not tuning.synced:
    raise ValueError("second_moment (Adam's v after the warm-up) needs synced=momentum or "
                     "synced=preconditioned in the same spec.")
  if tuning.ramp and not sj.methods.is_sparse(variant.method):
    raise ValueError(f"ramp (a density warm-up) needs a sparse method with a "
                     f"density; {variant.method!r} has none.")
  if tuning.sign and (not sj.methods.is_sparse(variant.method) or tuning.synced
                      or tuning.outer or tuning.momentum is not None or tuning.freeze
                      or tuning.lookahead):
    raise ValueError(f"sign=1 (DeMo: the sign of the synced momentum) needs a sparse method "
                     f"with error feedback ({variant.method!r} given) and takes no synced=, "
                     f"outer=, momentum=, freeze= or lookahead= (the sync's residual, decayed "
                     f"by decay=, is its momentum).")
  if tuning.lookahead and (not tuning.delay or tuning.synced or tuning.outer):
    raise ValueError("lookahead (the gradient taken one step ahead) needs delay=1 in the same "
                     "spec and the optimizer after the sync: not synced= (Adam around the "
                     "sync, the AdamW recipe's) nor outer=H.")
  return tuning


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
  opt_state = sj.init_opt_state(tx, params, mesh, axis_name=axis_name, param_specs=specs)
  state = TrainState(step=step, params=params, model_state=model_state, opt_state=opt_state)
  over_data = functools.partial(jax.tree.map, lambda _: PartitionSpec())
  return state, TrainState(
      step=PartitionSpec(), params=over_data(params), model_state=over_data(model_state),
      opt_state=sj.opt_state_specs(tx, params, mesh, axis_name=axis_name, param_specs=specs,
                                   axis_names={axis_name}))


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
               axis_name: str, task: str, seed: int) -> tuple[TrainState, StepMetrics]:
  """One step on this device's slice ``batch = (x, y, w)``; inside shard_map.

  The loss is the global weighted mean, so devices whose slices hold more scored targets
  (masked tokens, non-padding) weigh more: each device's loss is its weighted sum times
  ``P / total weight``, and the sync averages over the ``P`` devices.
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
          StepMetrics(loss=sums[0], metric=sums[1],
                      bytes_sent=sj.sync_stats(opt_state).bytes_sent))


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
  rows = PartitionSpec(axis_name)
  # Over the data axis only: on a mesh of several axes the compiler shards the model's
  # computation over the others (a partial-auto shard_map), and the sync its own.
  manual = {axis_name}
  train = jax.jit(jax.shard_map(
      functools.partial(train_step, model=model, tx=tx, axis_name=axis_name, task=task,
                        seed=seed),
      mesh=mesh, in_specs=(specs, rows), axis_names=manual,
      out_specs=(specs, StepMetrics(PartitionSpec(), PartitionSpec(), rows)), check_vma=False),
      out_shardings=None if shardings is None else (shardings, None))
  evaluate = jax.jit(jax.shard_map(
      functools.partial(eval_step, model=model, axis_name=axis_name, task=task), mesh=mesh,
      # Without the check: scans (LSTMs) start from unvarying zero carries on varying data.
      in_specs=(specs, rows), out_specs=PartitionSpec(), axis_names=manual, check_vma=False))
  return train, evaluate


def _host(x) -> np.ndarray:
  """This process's first copy/row of ``x`` (whole arrays may span processes)."""
  return np.asarray(x.addressable_data(0))


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
  """

  variant: str
  metric: str
  history: list
  num_params: int
  bytes_per_step: float
  time_per_step: float
  state: TrainState


def evaluate_model(evaluate, state: TrainState, ds: data.Dataset, mesh,
                   cfg: TrainConfig) -> tuple[float, float]:
  """Test-set mean loss and metric."""
  total = np.zeros(3)
  for batch in input_pipeline.eval_batches(ds.test, cfg.batch_size, mesh, cfg.axis_name,
                                           steps=cfg.eval_steps):
    total += _host(evaluate(state, sj.distributed.shard_rows(batch, mesh, cfg.axis_name,
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
  params = jax.tree.map(
      lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                           sharding=jax.sharding.NamedSharding(mesh, spec)),
      abstract, specs or jax.tree.map(lambda _: PartitionSpec(), abstract))
  tx = make_optimizer(cfg, variant, steps_per_epoch=steps, specs=specs)
  return _Run(model, steps, tx, example, params, specs)


# The flags a checkpoint's arrays depend on: resuming with another value would train another
# run on them. More --epochs continue the same run (except under a cosine schedule, whose
# decay they set), and another device count folds the residuals (train/checkpoint.py).
_RUN_FLAGS = {"model": "--model", "model_size": "--model-size", "dataset": "--dataset",
              "batch_size": "--batch-size", "lr": "--lr", "momentum": "--momentum",
              "lr_schedule": "--lr-schedule", "recipe": "--recipe",
              "optimizer": "--optimizer", "weight_decay": "--weight-decay", "seed": "--seed",
              "weight_decay_on": "--weight-decay-on", "adam_b2": "--adam-b2",
              "grad_clip": "--grad-clip", "lr_warmup": "--lr-warmup", "lr_final": "--lr-final",
              "seq_len": "--seq-len", "image_size": "--image-size"}


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
  specs = sj.opt_state_specs(tx, params, mesh, axis_name=cfg.axis_name, param_specs=layout,
                             axis_names={cfg.axis_name})
  opt_state = jax.eval_shape(
      lambda p: sj.init_opt_state(tx, p, mesh, axis_name=cfg.axis_name, param_specs=layout),
      params)
  update = jax.shard_map(lambda g, s, p: tx.update(g, s, p), mesh=mesh,
                         in_specs=(PartitionSpec(), specs, PartitionSpec()),
                         out_specs=(PartitionSpec(), specs), axis_names={cfg.axis_name},
                         check_vma=False)
  jax.eval_shape(update, params, opt_state, params)
  if checkpoint_dir:
    checkpoint.check_newest(checkpoint_dir, run_record(cfg, variant, run.steps))


def train_and_evaluate(cfg: TrainConfig, variant: Variant, ds: data.Dataset,
                       mesh: jax.sharding.Mesh, *, progress: bool = True,
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
  """
  from train import checkpoint

  model, steps, tx, example, _, layout = _setup(cfg, variant, ds, mesh)
  state, specs = create_train_state(jax.random.key(cfg.seed), model, tx, example, mesh,
                                    cfg.axis_name, layout)
  train, evaluate = compile_steps(model, tx, mesh, specs, cfg.axis_name, task=ds.task,
                                  seed=cfg.seed,
                                  shardings=jax.tree.map(lambda x: x.sharding, state))
  num_params = models.count(state.params)
  mgr = checkpoint.manager(checkpoint_dir) if checkpoint_dir else None
  restored = mgr and checkpoint.restore_latest(mgr, state)
  at, history = _Position.start(1), []
  run = run_record(cfg, variant, steps)
  if restored:
    step, state, record = restored
    checkpoint.check_same_run(record, run, step, checkpoint_dir)
    history, at = record["history"], _Position(**record["position"])
    log.info("%s: resumed from %s at epoch %d, step %d of %d", variant.label, checkpoint_dir,
             at.epoch, at.done, steps)
    if at.done >= steps:  # an epoch-end checkpoint: start the next epoch
      at = _Position.start(at.epoch + 1)
  loop = _Loop(variant.label, total=(cfg.epochs - at.epoch + 1) * steps - at.done,
               log_every=cfg.log_every, progress=progress)
  sent = history[-1]["bytes_sent"] if history else 0.0
  clock = history[-1].get("train_seconds", 0.0) if history else 0.0
  for epoch in range(at.epoch, cfg.epochs + 1):
    resume = epoch == at.epoch and at.done > 0
    epoch_start, compiled_before = time.perf_counter(), loop.compile_seconds
    loop.start_epoch(at.rows if resume else [])
    batches = input_pipeline.train_batches(ds.train, cfg.batch_size, mesh, cfg.axis_name,
                                           seed=cfg.seed, epoch=epoch,
                                           steps=cfg.steps_per_epoch,
                                           workers=cfg.data_workers,
                                           state=at.iterator if resume else None)
    for done, batch in enumerate(batches, start=at.done + 1 if resume else 1):
      batch = sj.distributed.shard_rows(batch, mesh, cfg.axis_name, local=True)
      if loop.step_fn is None:
        loop.compile(train, state, batch)
      state = loop.step(state, batch, epoch)
      step = (epoch - 1) * steps + done
      if mgr and cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and done < steps:
        position = _Position(epoch, done, loop.rows_so_far(epoch).tolist(),
                             batches.get_state())
        checkpoint.save(mgr, step, state, {"history": history, "run": run,
                                           "position": position._asdict()})
        loop.restart_clock()  # the save is not a step's time
    epoch_metrics = loop.fetch(epoch)  # (steps, 3): loss, metric, bytes per step
    clock += time.perf_counter() - epoch_start - (loop.compile_seconds - compiled_before)
    sent += float(epoch_metrics[:, 2].sum())
    test_loss, test_metric = evaluate_model(evaluate, state, ds, mesh, cfg)
    stats = sj.sync_stats(state.opt_state)
    history.append({"epoch": epoch, "steps": epoch * steps,
                    "train_loss": float(epoch_metrics[:, 0].mean()),
                    f"train_{ds.metric}": float(epoch_metrics[:, 1].mean()),
                    "test_loss": float(test_loss), f"test_{ds.metric}": float(test_metric),
                    "bytes_sent": sent, "train_seconds": clock,
                    "residual_norm": float(np.mean(_host(stats.residual_norm))),
                    "density": float(_host(stats.density)[0])})
    loop.log(f"epoch {epoch}/{cfg.epochs}: train loss {history[-1]['train_loss']:.4f}, "
             f"test {ds.metric} {test_metric:.4f}")
    if mgr:
      checkpoint.save(mgr, epoch * steps, state, {
          "history": history, "run": run,
          "position": _Position(epoch, steps, [], None)._asdict()})
  loop.close()
  if mgr:
    mgr.close()
  bytes_per_step = (history[-1]["bytes_sent"] / history[-1]["steps"] if history else
                    float(_host(sj.sync_stats(state.opt_state).bytes_sent)[0]))
  time_per_step = float(np.median(loop.times)) if loop.times else float("nan")
  return RunResult(variant.label, ds.metric, history, num_params, bytes_per_step,
                   time_per_step, state)


class _Position(NamedTuple):
  """Where a run is: ``done`` steps of ``epoch`` taken, their metric ``rows`` (loss,
  metric, bytes) and the Grain iterator's state after them (None at an epoch's start)."""

  epoch: int
  done: int
  rows: list
  iterator: dict | None

  @classmethod
  def start(cls, epoch: int) -> "_Position":
    """The start of ``epoch``: nothing taken yet."""
    return cls(epoch, 0, [], None)


class _Loop:
  """The train loop's bookkeeping: compile once (reported on its own line), dispatch steps
  without fetching anything (at most a few ahead on simulated CPU devices, see
  :func:`spardl_jax.bounded_dispatch`), and fetch the metrics of a whole log interval at once.

  Step times: a log interval's wall time is spread over its steps (dispatch runs ahead, so
  timing each call would only measure the dispatch); evaluations and checkpoint saves
  between intervals are left out.
  """

  def __init__(self, label: str, *, total: int, log_every: int, progress: bool):
    self.label, self.total, self.log_every = label, total, log_every
    self.interactive = progress and jax.process_index() == 0 and sys.stderr.isatty()
    self.logging = jax.process_index() == 0  # one process logs
    self.quiet = not progress or not self.logging  # no bar or step lines
    self.step_fn, self.bar = None, None
    self.pending, self.epoch_rows, self.times = [], [], []
    self.interval_start, self.done = None, 0
    self.compile_seconds = 0.0

  def compile(self, train, state, batch) -> None:
    start = time.perf_counter()
    self.step_fn = sj.bounded_dispatch(train.lower(state, batch).compile())
    self.compile_seconds = time.perf_counter() - start
    self.log(f"train step compiled in {self.compile_seconds:.1f} s")
    if self.interactive:  # after the compile, so the bar's rate and ETA are real
      self.bar = tqdm(total=self.total, desc=self.label, unit="step", leave=False)
    self.interval_start = time.perf_counter()

  def step(self, state, batch, epoch: int):
    state, metrics = self.step_fn(state, batch)
    self.pending.append(metrics)
    if len(self.pending) >= self.log_every:
      self._drain(epoch)
    return state

  def _drain(self, epoch: int, *, announce: bool = True) -> None:
    if not self.pending:
      return
    # Bytes: the first device's (the most any device sends, for gTopk's root).
    rows = np.array([[_host(m.loss), _host(m.metric), _host(m.bytes_sent)[0]]
                     for m in self.pending], np.float64)
    now = time.perf_counter()
    self.times += [(now - self.interval_start) / len(rows)] * len(rows)
    self.interval_start = now
    self.epoch_rows.append(rows)
    self.done += len(rows)
    self.pending = []
    if self.bar is not None:
      self.bar.update(len(rows))
      self.bar.set_postfix(epoch=epoch, loss=f"{rows[-1, 0]:.3f}")
    elif announce and not self.quiet:
      log.info("%s: step %d/%d, loss %.4f", self.label, self.done, self.total, rows[-1, 0])

  def start_epoch(self, rows: list) -> None:
    """Starts an epoch's metrics, with the rows of steps a checkpoint already took."""
    self.epoch_rows = [np.asarray(rows, np.float64).reshape(-1, 3)]
    self.restart_clock()  # the evaluation since the last fetch is not a step's time

  def restart_clock(self) -> None:
    """The next log interval's time starts now (after work that is not a train step)."""
    self.interval_start = time.perf_counter()

  def rows_so_far(self, epoch: int) -> np.ndarray:
    """This epoch's ``(steps, 3)`` metrics (loss, metric, bytes) up to now, fetched now."""
    self._drain(epoch, announce=False)
    return np.concatenate(self.epoch_rows)

  def fetch(self, epoch: int) -> np.ndarray:
    """This epoch's ``(steps, 3)`` metrics, fetched now; the next epoch starts empty."""
    self._drain(epoch, announce=False)  # the epoch's own line follows
    rows, self.epoch_rows = np.concatenate(self.epoch_rows), []
    return rows

  def log(self, message: str) -> None:
    """A line of the run's record (the compile, each epoch), also with progress off."""
    if not self.logging:
      return
    if self.bar is not None:
      self.bar.write(f"{self.label}: {message}")
    else:
      log.info("%s: %s", self.label, message)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
