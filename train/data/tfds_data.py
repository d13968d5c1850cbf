"""TFDS datasets read through ``tfds.data_source`` (random access, no TensorFlow).

Data must be prepared beforehand, in the ``array_record`` format, under ``--data-dir``;
nothing is downloaded here (offline TFDS downloads hang for minutes). On a machine with
internet::

    pip install tensorflow-datasets tensorflow
    python -c "import tensorflow_datasets as tfds; tfds.builder('cifar10', \\
        data_dir='DIR', file_format='array_record').download_and_prepare()"

then copy ``DIR`` to ``--data-dir``. ImageNet needs its tar files first (TFDS's
``imagenet2012`` page: ``download_config=tfds.download.DownloadConfig(manual_dir=...)``).
"""

from __future__ import annotations

import numpy as np

from train.data import text
from train.data.corpora import corpus_objective
from train.data.types import Batch, Dataset, Request, Split, token_split

# name -> (train split, test split); Wikipedia has only "train", so 1 % of it is held out.
SPLITS = {"cifar10": ("train", "test"), "cifar100": ("train", "test"),
          "imagenet2012": ("train", "validation"), "imdb_reviews": ("train", "test"),
          "lm1b": ("train", "test"), "wikipedia": ("train[1%:]", "train[:1%]")}
# Per-channel mean and standard deviation of CIFAR and ImageNet pixels (0..1).
_MEAN, _STD = np.float32([0.485, 0.456, 0.406]), np.float32([0.229, 0.224, 0.225])
# Examples of the training split that the word vocabulary is counted over.
VOCAB_EXAMPLES = 20_000


class NotPreparedError(FileNotFoundError):
  """A TFDS dataset is not prepared (as array_record) under ``--data-dir``."""


def source(name: str, split: str, data_dir: str | None):
  """``tfds.data_source`` of a prepared dataset; :class:`NotPreparedError` says how to prepare."""
  try:
    import tensorflow_datasets as tfds
  except ImportError as e:
    raise ModuleNotFoundError(f"--dataset {name} reads TFDS data: pip install -e '.[tfds]'"
                              ) from e
  if name.startswith("wikipedia"):
    import tensorflow_datasets.text.wikipedia  # noqa: F401  (registers its configs)
  if data_dir is None:
    raise NotPreparedError(f"--dataset {name} needs --data-dir, the TFDS data directory it "
                           f"was prepared in. {_HOW % (name, 'DIR')}")
  try:
    return tfds.data_source(name, split=split, data_dir=data_dir, download=False)
  except Exception as e:  # TFDS raises several types; all mean "not usable as prepared".
    prepared = tfds.builder(name, data_dir=data_dir).is_prepared()
    state = ("is prepared in another file format (data_source needs array_record)"
             if prepared else "is not prepared")
    raise NotPreparedError(f"--dataset {name} {state} under --data-dir {data_dir!r}. "
                           f"{_HOW % (name, data_dir)}") from e


_HOW = ("On a machine with internet, run: pip install tensorflow-datasets tensorflow; "
        "python -c \"import tensorflow_datasets as tfds; tfds.builder('%s', data_dir='%s', "
        "file_format='array_record').download_and_prepare()\" and copy the directory here "
        "(see train/data/tfds_data.py).")


def _records(src, idx: np.ndarray) -> list[dict]:
  return [src[int(i)] for i in idx]


def _image(img: np.ndarray, size: int | None) -> np.ndarray:
  """``(H, W, 3)`` uint8 -> normalized float32; with ``size``, resized (shorter side
  ``size * 8 / 7``) and center-cropped to ``(size, size, 3)`` as in ImageNet evaluation."""
  if size is not None:
    from PIL import Image

    pil = Image.fromarray(img)
    scale = size * 8 / 7 / min(pil.size)
    pil = pil.resize((max(size, round(pil.width * scale)), max(size, round(pil.height * scale))),
                     Image.BILINEAR)
    left, top = (pil.width - size) // 2, (pil.height - size) // 2
    img = np.asarray(pil.crop((left, top, left + size, top + size)))
  return (img.astype(np.float32) / 255 - _MEAN) / _STD


def _image_split(src, size: int | None, augment=None) -> Split:
  def take(idx):
    recs = _records(src, idx)
    x = np.stack([_image(r["image"], size) for r in recs])
    y = np.array([r["label"] for r in recs], np.int32)
    return x, y, np.ones(len(y), np.float32)
  return Split(len(src), take, augment)


def _text(record) -> str:
  t = record["text"]
  return t.decode("utf-8", "replace") if isinstance(t, bytes) else str(t)


def _vocabulary(src, req: Request) -> text.Vocabulary:
  count = min(len(src), VOCAB_EXAMPLES)
  return text.Vocabulary.build((text.words(_text(src[i])) for i in range(count)),
                               req.vocab_size or 30_000)


def load(name: str, req: Request) -> Dataset:
  """TFDS dataset ``name`` (a key of :data:`SOURCES`, or ``wikipedia/<config>``).

  The word vocabulary (text and corpora) is counted over the first
  :data:`VOCAB_EXAMPLES` training examples, ``req.vocab_size`` words at most.
  """
  base = name.split("/")[0]
  train, test = (source(name, s, req.data_dir) for s in SPLITS[base])
  kind = KINDS[base]
  if kind == "image":
    size = req.image_size if base == "imagenet2012" else None
    num_classes = {"cifar10": 10, "cifar100": 100, "imagenet2012": 1000}[base]
    # CIFAR trains with random crops and flips; ImageNet with center crops only.
    augment = crop_and_flip if size is None else None
    return Dataset(name, kind, "classify", _image_split(train, size, augment),
                   _image_split(test, size), {"num_classes": num_classes})
  vocab = _vocabulary(train, req)

  def ids(records):
    return [vocab.encode(text.words(_text(r))) for r in records]

  if kind == "text":
    def split(src):
      def take(idx):
        recs = _records(src, idx)
        return (text.pad_to(ids(recs), req.seq_len),
                np.array([r["label"] for r in recs], np.int32), np.ones(len(recs), np.float32))
      return Split(len(src), take)
    return Dataset(name, kind, "classify", split(train), split(test),
                   {"num_classes": 2, "vocab_size": len(vocab)})
  objective = corpus_objective(name, req)

  def corpus_split(src, seed):
    tokens = text.sequences(lambda idx: ids(_records(src, idx)), len(src), req.seq_len)
    return token_split(tokens, objective, vocab_size=len(vocab), seed=seed)

  return Dataset(name, kind, objective, corpus_split(train, req.seed),
                 corpus_split(test, req.seed + 1), {"vocab_size": len(vocab)})


def crop_and_flip(batch: Batch, indices: np.ndarray, *, seed: int, epoch: int,
                  pad: int = 4) -> Batch:
  """The standard CIFAR augmentation: a random crop of the zero-padded image (``pad`` pixels
  each side) and a random horizontal flip, drawn per (seed, epoch, example index)."""
  x, y, w = batch
  b, h, wd = x.shape[:3]
  padded = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  out = np.empty_like(x)
  for row, index in enumerate(indices):
    dy, dx, flip = np.random.default_rng([seed, epoch, int(index)]).integers(
        0, [2 * pad + 1, 2 * pad + 1, 2])
    crop = padded[row, dy:dy + h, dx:dx + wd]
    out[row] = crop[:, ::-1] if flip else crop
  return out, y, w


def _loader(name: str):
  return lambda req: load(name, req)


KINDS = {"cifar10": "image", "cifar100": "image", "imagenet2012": "image",
         "imdb_reviews": "text", "lm1b": "corpus", "wikipedia": "corpus"}
SOURCES = {name: (kind, _loader("wikipedia/20230601.en" if name == "wikipedia" else name))
           for name, kind in KINDS.items()}
