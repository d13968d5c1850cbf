"""Offline datasets and the data-parallel input pipeline.

Datasets here need no download: MNIST-1D is generated locally by the ``mnist1d`` package,
scikit-learn ships the 8x8 ``digits`` images. Every global batch is split evenly over the
devices of the data axis (:func:`spardl_jax.data_parallel.shard_rows`); in a multi-process
run each process puts only the rows of its own devices on them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

DATASETS = ("mnist1d", "digits")


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A classification dataset in memory.

  Attributes:
    x_train, x_test: ``(N, ...)`` float32 inputs.
    y_train, y_test: ``(N,)`` int32 labels in ``[0, num_classes)``.
    num_classes: number of classes.
  """

  name: str
  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int


def _mnist1d(seed: int) -> Dataset:
  from mnist1d.data import get_dataset_args, make_dataset

  args = get_dataset_args()
  args.seed = seed
  d = make_dataset(args)
  return Dataset("mnist1d", d["x"].astype(np.float32), d["y"].astype(np.int32),
                 d["x_test"].astype(np.float32), d["y_test"].astype(np.int32), 10)


def _digits(seed: int) -> Dataset:
  from sklearn.datasets import load_digits

  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(y))
  test = order[:360]
  train = order[360:]
  return Dataset("digits", x[train], y[train], x[test], y[test], 10)


def load(name: str, seed: int = 0) -> Dataset:
  """Loads (or generates) the dataset ``name`` (one of :data:`DATASETS`)."""
  loaders = {"mnist1d": _mnist1d, "digits": _digits}
  if name not in loaders:
    raise ValueError(f"--dataset must be one of {list(DATASETS)}, got {name!r}.")
  return loaders[name](seed)


def train_batches(ds: Dataset, batch_size: int, *, seed: int, epoch: int
                  ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Shuffled ``(x, y)`` global batches of one epoch; the last partial batch is dropped."""
  order = np.random.default_rng([seed, epoch]).permutation(len(ds.y_train))
  for start in range(0, len(order) - batch_size + 1, batch_size):
    idx = order[start:start + batch_size]
    yield ds.x_train[idx], ds.y_train[idx]


def eval_batches(ds: Dataset, batch_size: int
                 ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """``(x, y, weight)`` batches covering the whole test set; padding rows have weight 0."""
  n = len(ds.y_test)
  for start in range(0, n, batch_size):
    x, y = ds.x_test[start:start + batch_size], ds.y_test[start:start + batch_size]
    pad = batch_size - len(y)
    weight = np.concatenate([np.ones(len(y), np.float32), np.zeros(pad, np.float32)])
    yield (np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]),
           np.concatenate([y, np.zeros(pad, y.dtype)]), weight)
