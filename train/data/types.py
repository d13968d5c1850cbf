"""The types every data source shares: a random-access :class:`Split`, a loaded
:class:`Dataset`, and the :class:`Request` a model makes of a dataset.

Batches are ``x (b, ...)`` inputs, ``y`` labels (``(b,)`` int32), regression targets
(``(b,)`` float32) or target tokens (``(b, L)`` int32), and ``w`` float32 weights shaped like
``y`` (0 for padding and unscored tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import numpy as np

from train.data import text

Task = Literal["classify", "regress", "lm", "mlm"]
Batch = text.Batch


@dataclasses.dataclass(frozen=True)
class Split:
  """``size`` examples; ``take(indices (b,) int) -> (x, y, w)`` reads those examples.

  ``augment(batch, indices, seed=, epoch=) -> batch``, when set, is applied to training
  batches; it must depend only on its arguments (a resumed run repeats it).
  """

  size: int
  take: Callable[[np.ndarray], Batch]
  augment: Callable[..., Batch] | None = None

  def __len__(self) -> int:
    return self.size


def array_split(x: np.ndarray, y: np.ndarray) -> Split:
  """A split of in-memory arrays (weights all 1)."""
  ones = np.ones(y.shape, np.float32)
  return Split(len(y), lambda idx: (x[idx], y[idx], ones[idx]))


def token_split(tokens: text.TokenSplit, objective: str, *, vocab_size: int,
                seed: int) -> Split:
  """A corpus split trained with ``objective`` (see :mod:`train.text`)."""
  return Split(tokens.size, text.objective(tokens, objective, vocab_size=vocab_size, seed=seed))


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A loaded dataset.

  Attributes:
    name: its ``--dataset`` name.
    kind: what models read it (``"image"``, ``"signal"``, ``"text"``, ``"corpus"``).
    task: the loss and metric: ``"classify"`` (cross-entropy, accuracy), ``"regress"``
      (squared error, mean absolute error), ``"lm"``/``"mlm"`` (token cross-entropy, token
      accuracy).
    train, test: the splits.
    info: what it fixes in the model: ``num_classes`` or ``vocab_size``.
  """

  name: str
  kind: str
  task: Task
  train: Split
  test: Split
  info: dict

  @property
  def metric(self) -> str:
    return "mae" if self.task == "regress" else "accuracy"


@dataclasses.dataclass(frozen=True)
class Request:
  """What the model asks of a dataset: the corpus objective and the text sizes.

  Attributes:
    objective: ``"lm"`` or ``"mlm"`` for a corpus (None for other models).
    vocab_size: the largest vocabulary to build from word-level text.
    seq_len: tokens per example for text and corpora.
    image_size: side of ImageNet crops.
    data_dir: where prepared data live (TFDS, PTB, House).
    seed: the seed of splits and masks.
  """

  objective: str | None = None
  vocab_size: int | None = None
  seq_len: int = 128
  image_size: int = 224
  data_dir: str | None = None
  seed: int = 0
