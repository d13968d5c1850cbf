"""Training configuration: the defaults are the main job (MNIST-1D, 8 devices, dense vs SparDL 1 %)."""

from __future__ import annotations

import dataclasses

from spardl_jax import methods


@dataclasses.dataclass(frozen=True)
class Variant:
  """One gradient-sync method to train with.

  Attributes:
    label: the name in tables and plots, e.g. ``spardl:density=0.001``.
    method: a name from :data:`spardl_jax.methods.METHODS`.
    options: the method's options (``density``, ``teams``, ``residuals`` for SparDL).
  """

  label: str
  method: str
  options: dict


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  model: str = "cnn1d"
  model_size: str = "full"
  dataset: str = "mnist1d"
  variants: tuple[Variant, ...] = ()
  devices: int | None = None  # None: every device (8 simulated CPU devices in one process)
  epochs: int = 30
  batch_size: int = 128
  lr: float = 0.05
  momentum: float = 0.9  # SGD's
  optimizer: str = "sgd"  # or "adamw" (BERT)
  weight_decay: float = 0.01  # AdamW's
  seed: int = 0
  out: str = "train_out"
  axis_name: str = "data"
  data_dir: str | None = None
  seq_len: int | None = None  # None: the model's (256 IMDB, 35 PTB, 128 BERT)
  image_size: int = 224  # ImageNet crops
  steps_per_epoch: int | None = None  # None: one pass over the training set
  eval_steps: int | None = None  # None: the whole test set
  log_every: int = 50  # steps between fetches of the metrics to the host
  data_workers: int = 0  # Grain worker processes that read and decode batches (0: a thread)
  checkpoint_every: int | None = None  # steps between checkpoints inside an epoch


def parse_variant(text: str, *, density: float, teams, sag: str, residuals: str) -> Variant:
  """``method[:key=value...]`` (see :func:`spardl_jax.methods.parse`) -> :class:`Variant`;
  options not in ``text`` come from ``--density``, ``--teams``, ``--sag``, ``--residuals``."""
  method, options = methods.parse(text, density=density, teams=teams, sag=sag,
                                  residuals=residuals)
  return Variant(text, method, options)
