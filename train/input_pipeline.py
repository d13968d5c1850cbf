"""The data-parallel input pipeline on Grain: what each process reads, in what order.

* One seeded shuffle per epoch (``grain.MapDataset.shuffle`` with a seed drawn from
  ``(seed, epoch)``), the same in every process, orders the training set.
* Each global batch of ``B`` indices is cut into the rows of this process's devices
  (:func:`spardl_jax.distributed.process_rows`) and only those examples are read (the
  splits are random access, ``split.take(indices)``) and put on the devices
  (``shard_rows(..., local=True)``), as multi-host JAX expects.
* Reading (decoding, augmenting) runs ahead of the train loop in Grain's reader threads, or
  in ``workers`` separate processes (``--data-workers``; for image decoding with PIL).
* The iterator is Grain's checkpointable :class:`grain.DatasetIterator`: ``get_state()``
  after any step and ``set_state(...)`` on a fresh iterator of the same epoch repeat the rest
  of the epoch exactly.
* The test split is read in order, padded to whole batches with weight-0 rows.

The datasets themselves are in :mod:`train.data`.
"""

from __future__ import annotations

import functools

import grain
from absl import flags
import jax
import numpy as np

import spardl_jax as sj
from train.data.types import Batch, Split

# Batches read ahead of the train loop. One reader thread keeps the reads in step order (a
# process's reads are then a plain sequence, which the multi-process test checks); decoding
# that needs more goes to worker processes.
PREFETCH = 4


def epoch_seed(seed: int, epoch: int) -> int:
  """The shuffle seed of ``epoch``: a function of ``(seed, epoch)`` only, so a resumed run
  reads the same order."""
  return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def _read_train(split: Split, rows: slice, seed: int, epoch: int, indices: np.ndarray) -> Batch:
  idx = np.asarray(indices)[rows]
  batch = split.take(idx)
  return split.augment(batch, idx, seed=seed, epoch=epoch) if split.augment else batch


def _read_eval(split: Split, rows: slice, batch_size: int, end: int, step: int) -> Batch:
  idx = np.arange(step * batch_size, (step + 1) * batch_size)
  real = idx < end
  x, y, w = split.take(np.where(real, idx, 0)[rows])
  return x, y, w * real[rows].reshape((-1,) + (1,) * (w.ndim - 1))


def train_dataset(split: Split, batch_size: int, mesh: jax.sharding.Mesh, axis_name: str, *,
                  seed: int, epoch: int, steps: int | None = None) -> grain.MapDataset:
  """This process's rows of each shuffled global batch of one epoch (the partial batch
  dropped), ``steps`` batches at most, as a Grain dataset (one element per step)."""
  rows = sj.distributed.process_rows(batch_size, mesh, axis_name)
  count = steps_per_epoch(split, batch_size, steps) * batch_size
  order = grain.MapDataset.range(len(split)).shuffle(seed=epoch_seed(seed, epoch))[:count]
  return order.batch(batch_size).map(functools.partial(_read_train, split, rows, seed, epoch))


def eval_dataset(split: Split, batch_size: int, mesh: jax.sharding.Mesh, axis_name: str, *,
                 steps: int | None = None) -> grain.MapDataset:
  """This process's rows of batches covering ``split`` in order (the first ``steps`` batches
  with ``steps``); padding rows weigh 0."""
  rows = sj.distributed.process_rows(batch_size, mesh, axis_name)
  end = len(split) if steps is None else min(len(split), steps * batch_size)
  return grain.MapDataset.range(-(-end // batch_size)).map(
      functools.partial(_read_eval, split, rows, batch_size, end))


def iterate(dataset: grain.MapDataset, *, workers: int = 0,
            state: dict | None = None) -> grain.DatasetIterator:
  """A checkpointable iterator over ``dataset`` that reads ahead in threads, or in
  ``workers`` processes; ``state`` (from ``get_state()``) resumes where it was taken."""
  ds = dataset.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=PREFETCH))
  if workers:
    if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags; we parse none of ours
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  iterator = iter(ds)
  if state is not None:
    iterator.set_state(state)
  return iterator


def train_batches(split: Split, batch_size: int, mesh: jax.sharding.Mesh, axis_name: str, *,
                  seed: int, epoch: int, steps: int | None = None, workers: int = 0,
                  state: dict | None = None) -> grain.DatasetIterator:
  """:func:`iterate` over :func:`train_dataset`."""
  return iterate(train_dataset(split, batch_size, mesh, axis_name, seed=seed, epoch=epoch,
                               steps=steps), workers=workers, state=state)


def eval_batches(split: Split, batch_size: int, mesh: jax.sharding.Mesh, axis_name: str, *,
                 steps: int | None = None, workers: int = 0) -> grain.DatasetIterator:
  """:func:`iterate` over :func:`eval_dataset`."""
  return iterate(eval_dataset(split, batch_size, mesh, axis_name, steps=steps),
                 workers=workers)


def steps_per_epoch(split: Split, batch_size: int, cap: int | None = None) -> int:
  """Whole batches in ``split``, ``cap`` at most."""
  whole = len(split) // batch_size
  return whole if cap is None else min(whole, cap)
