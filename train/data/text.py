"""Text for the language cases: vocabularies, token splits, and the two training objectives.

A *token split* holds fixed-length token sequences ``(b, L + 1)`` int32 (0 = padding) and is
turned into model batches by an objective:

* ``"lm"`` (LSTM-PTB): inputs are tokens ``0..L-1``, targets tokens ``1..L``;
* ``"mlm"`` (BERT): 15 % of the non-padding tokens of ``0..L-1`` are chosen, 80 % of those
  become ``<mask>``, 10 % a random token, 10 % stay; the model predicts the chosen ones.
  Masks are a pure function of (seed, example index), so a resumed run sees the same ones.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Sequence

import numpy as np

PAD, UNK, MASK = 0, 1, 2
SPECIALS = ("<pad>", "<unk>", "<mask>")
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[^\sa-z0-9]")

# (x (b, ...), y (b, ...), w float32 like y: 0 marks padding / unscored targets)
Batch = tuple[np.ndarray, np.ndarray, np.ndarray]


def words(text: str) -> list[str]:
  """Lower-case words and single punctuation marks."""
  return _WORD.findall(text.lower())


@dataclasses.dataclass(frozen=True)
class Vocabulary:
  """Token strings <-> int ids; ids 0, 1, 2 are ``<pad>``, ``<unk>``, ``<mask>``."""

  tokens: tuple[str, ...]

  @classmethod
  def build(cls, texts: Iterable[Sequence[str]], size: int) -> Vocabulary:
    """The ``size - 3`` most frequent tokens of ``texts`` (ties by first appearance)."""
    counts = collections.Counter()
    for t in texts:
      counts.update(t)
    for s in SPECIALS:
      counts.pop(s, None)
    return cls(SPECIALS + tuple(w for w, _ in counts.most_common(max(size - len(SPECIALS), 0))))

  def __len__(self) -> int:
    return len(self.tokens)

  @functools.cached_property
  def ids(self) -> dict[str, int]:
    return {t: i for i, t in enumerate(self.tokens)}

  def encode(self, tokens: Sequence[str]) -> np.ndarray:
    """``(len(tokens),)`` int32 ids; unknown tokens are ``<unk>``."""
    ids = self.ids
    return np.fromiter((ids.get(t, UNK) for t in tokens), np.int32, len(tokens))


def pad_to(ids: Sequence[np.ndarray], length: int) -> np.ndarray:
  """``(len(ids), length)`` int32: each sequence cut or padded with ``<pad>`` at the end."""
  out = np.full((len(ids), length), PAD, np.int32)
  for row, seq in zip(out, ids):
    row[:min(len(seq), length)] = seq[:length]
  return out


@dataclasses.dataclass(frozen=True)
class TokenSplit:
  """``size`` sequences of ``length + 1`` tokens, read by ``take(indices) -> (b, L + 1)``."""

  size: int
  length: int
  take: Callable[[np.ndarray], np.ndarray]


def windows(stream: np.ndarray, length: int) -> TokenSplit:
  """Consecutive non-overlapping windows of a token stream (PTB, Shakespeare).

  Window ``i`` is ``stream[i L : (i + 1) L + 1]``: its last token is the next window's first,
  so every token is a target exactly once.
  """
  size = (len(stream) - 1) // length
  if size < 1:
    raise ValueError(f"--seq-len {length} is longer than the corpus ({len(stream)} tokens).")
  offsets = np.arange(length + 1)
  return TokenSplit(size, length, lambda idx: stream[np.asarray(idx)[:, None] * length + offsets])


def sequences(read: Callable[[np.ndarray], list[np.ndarray]], size: int,
              length: int) -> TokenSplit:
  """Examples read one by one as id arrays (TFDS text), cut or padded to ``length + 1``."""
  return TokenSplit(size, length, lambda idx: pad_to(read(np.asarray(idx)), length + 1))


def mask_tokens(tokens: np.ndarray, indices: np.ndarray, vocab_size: int, seed: int,
                rate: float = 0.15) -> Batch:
  """BERT's masking of ``tokens (b, L)``; row ``j``'s choice depends on ``(seed, indices[j])``.

  Returns ``(inputs, tokens, weights)``: ``weights`` is 1 where a token was chosen.
  """
  inputs = tokens.copy()
  weights = np.zeros(tokens.shape, np.float32)
  for row, index in enumerate(indices):
    rng = np.random.default_rng([seed, int(index)])
    real = np.flatnonzero(tokens[row] != PAD)
    if not len(real):
      continue
    chosen = rng.choice(real, max(1, round(rate * len(real))), replace=False)
    action = rng.random(len(chosen))
    weights[row, chosen] = 1.0
    inputs[row, chosen[action < 0.8]] = MASK
    rand = chosen[(action >= 0.8) & (action < 0.9)]
    inputs[row, rand] = rng.integers(len(SPECIALS), vocab_size, len(rand))
  return inputs, tokens, weights


def objective(split: TokenSplit, kind: str, *, vocab_size: int, seed: int
              ) -> Callable[[np.ndarray], Batch]:
  """``take(indices) -> (x, y, w)`` batches of ``split`` for ``kind`` ``"lm"`` or ``"mlm"``."""
  if kind == "lm":
    def take(idx):
      seq = split.take(idx)
      return seq[:, :-1], seq[:, 1:], (seq[:, 1:] != PAD).astype(np.float32)
  elif kind == "mlm":
    def take(idx):
      return mask_tokens(split.take(idx)[:, :-1], np.asarray(idx), vocab_size, seed)
  else:
    raise ValueError(f"objective must be 'lm' or 'mlm', got {kind!r}.")
  return take
