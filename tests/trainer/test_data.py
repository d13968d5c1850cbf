"""Datasets and the input pipeline: TFDS loaders on mock data, PTB, House, Shakespeare, MLM
masking, per-process rows, and clear errors for data that is not there."""

import time

import grain
import numpy as np
import pytest
import tensorflow_datasets as tfds

from spardl_jax._src.parallel.rows import process_rows
from tests import data_files
from train import data, input_pipeline
from train.data import corpora, text, tfds_data
from train.data.types import Request
from train import check_model_data, make_mesh


def first(split, n=4):
  return split.take(np.arange(n))


# name, request, x shape and dtype, y shape, task
TFDS_CASES = [
    ("cifar10", Request(), (4, 32, 32, 3), np.float32, (4,), "classify"),
    ("cifar100", Request(), (4, 32, 32, 3), np.float32, (4,), "classify"),
    ("imagenet2012", Request(image_size=24), (4, 24, 24, 3), np.float32, (4,), "classify"),
    ("imdb_reviews", Request(seq_len=12, vocab_size=50), (4, 12), np.int32, (4,), "classify"),
    ("lm1b", Request(objective="lm", seq_len=12, vocab_size=50), (4, 12), np.int32, (4, 12),
     "lm"),
    ("lm1b", Request(objective="mlm", seq_len=12, vocab_size=50), (4, 12), np.int32, (4, 12),
     "mlm"),
    ("wikipedia/20201201.en", Request(objective="mlm", seq_len=12), (4, 12), np.int32, (4, 12),
     "mlm"),
]


@pytest.mark.parametrize("name,req,x_shape,x_dtype,y_shape,task", TFDS_CASES)
def test_tfds_loaders_on_mock_data(tmp_path, name, req, x_shape, x_dtype, y_shape, task):
  with tfds.testing.mock_data(num_examples=6, data_dir=str(tmp_path)):
    ds = data.load(name, Request(**{**req.__dict__, "data_dir": str(tmp_path)}))
    x, y, w = first(ds.train)
    xt, yt, wt = first(ds.test)
  assert ds.task == task and len(ds.train) == len(ds.test) == 6
  assert x.shape == xt.shape == x_shape and x.dtype == x_dtype
  assert y.shape == yt.shape == w.shape == y_shape and w.dtype == np.float32
  if task == "classify":
    assert np.all((0 <= y) & (y < ds.info["num_classes"])) and np.all(w == 1)
  if x_dtype == np.int32:
    vocab = ds.info["vocab_size"]
    assert vocab <= (req.vocab_size or 30_000) and np.all((0 <= x) & (x < vocab))
  if task == "lm":
    # The next token is the target, and padding is not scored.
    np.testing.assert_array_equal(w, (y != text.PAD).astype(np.float32))
  if task == "mlm":
    # Some real token of each row is scored; unscored positions are the text itself.
    assert np.all(w.sum(1)[(y != text.PAD).any(1)] >= 1)
    np.testing.assert_array_equal(x[w == 0], y[w == 0])


def test_tfds_not_prepared_is_a_clear_error_not_a_hang(tmp_path):
  start = time.monotonic()
  with pytest.raises(tfds_data.NotPreparedError,
                     match=r"cifar10 is not prepared under --data-dir .*download_and_prepare"):
    data.load("cifar10", Request(data_dir=str(tmp_path)))
  with pytest.raises(tfds_data.NotPreparedError, match="needs --data-dir"):
    data.load("imdb_reviews", Request())
  assert time.monotonic() - start < 30


def test_ptb_from_text_files(tmp_path):
  data_files.write_ptb(tmp_path)
  ds = data.load("ptb", Request(objective="lm", seq_len=4, data_dir=str(tmp_path)))
  words = " ".join(data_files.PTB_TRAIN).split()
  # Vocabulary: the specials, then every training word and <eos> (PTB's <unk> is ours).
  assert ds.info["vocab_size"] == 3 + len(set(words) - {"<unk>"}) + 1
  stream_len = len(words) + len(data_files.PTB_TRAIN)
  assert len(ds.train) == (stream_len - 1) // 4
  x, y, w = ds.train.take(np.arange(len(ds.train)))
  # Windows tile the stream: each target is the next input, across window boundaries.
  np.testing.assert_array_equal(x.ravel()[1:], y.ravel()[:-1])
  assert np.all(w == 1)
  assert (x == text.UNK).sum() == 1  # the one <unk> of the training text
  with pytest.raises(FileNotFoundError, match="ptb.train.txt .*simple-examples"):
    data.load("ptb", Request(objective="lm", data_dir=str(tmp_path / "none")))


def test_house_montages_and_normalized_prices(tmp_path):
  prices = data_files.write_house(tmp_path, houses=10)
  ds = data.load("house", Request(data_dir=str(tmp_path)))
  assert ds.task == "regress" and ds.metric == "mae"
  assert (len(ds.train), len(ds.test)) == (8, 2)
  x, y, w = first(ds.train, 8)
  assert x.shape == (8, 64, 64, 3) and x.dtype == np.float32
  assert y.dtype == np.float32 and y.max() == 1.0  # divided by the largest training price
  xt, yt, _ = first(ds.test, 2)
  # Every house is in one split, its price scaled by one factor.
  ratio = np.concatenate([y, yt]) / np.concatenate([y, yt]).min()
  np.testing.assert_allclose(np.sort(ratio), np.sort(prices / prices.min()), rtol=1e-5)
  with pytest.raises(FileNotFoundError, match="HousesInfo.txt"):
    data.load("house", Request(data_dir=str(tmp_path / "none")))


def test_shakespeare_is_offline_character_text():
  train, test = corpora.shakespeare_text()
  assert len(train) > 4_000_000 and len(test) > 200_000
  assert "To be, or not to be" in train + test and "**" not in train
  ds = data.load("shakespeare", Request(objective="lm", seq_len=64))
  assert ds.info["vocab_size"] < 128
  x, y, _ = first(ds.test)
  assert x.shape == y.shape == (4, 64)
  with pytest.raises(ValueError, match="shakespeare is a text corpus"):
    data.load("shakespeare", Request())


def test_mlm_masks_are_bert_like_and_repeatable():
  tokens = np.random.default_rng(0).integers(3, 100, (400, 50)).astype(np.int32)
  tokens[:, 40:] = text.PAD
  idx = np.arange(400)
  x, y, w = text.mask_tokens(tokens, idx, 100, seed=1)
  np.testing.assert_array_equal(y, tokens)
  assert np.all(w[:, 40:] == 0) and np.all(w.sum(1) == 6)  # 15 % of 40 real tokens
  chosen = w == 1
  masked = (x == text.MASK) & chosen
  kept = (x == tokens) & chosen
  assert 0.75 < masked.sum() / chosen.sum() < 0.85
  assert 0.06 < kept.sum() / chosen.sum() < 0.16  # 10 % kept, plus random hits
  np.testing.assert_array_equal(x[~chosen], tokens[~chosen])
  # A row's mask depends on (seed, index) only, not on the batch it is read in.
  x2, _, w2 = text.mask_tokens(tokens[[7, 3]], idx[[7, 3]], 100, seed=1)
  np.testing.assert_array_equal(x2, x[[7, 3]])
  np.testing.assert_array_equal(w2, w[[7, 3]])


def test_batches_cover_the_data_in_one_process():
  ds = data.load("digits")
  mesh = make_mesh(4)
  assert process_rows(64, mesh, "data") == slice(0, 64)
  with pytest.raises(ValueError, match=r"batch rows \(62\) must be a multiple"):
    process_rows(62, mesh, "data")
  seen = np.concatenate([y for _, y, _ in input_pipeline.train_batches(
      ds.train, 64, mesh, "data", seed=0, epoch=1)])
  assert len(seen) == len(ds.train) // 64 * 64
  capped = list(input_pipeline.train_batches(ds.train, 64, mesh, "data", seed=0, epoch=1,
                                             steps=3))
  assert len(capped) == 3
  batches = list(input_pipeline.eval_batches(ds.test, 64, mesh, "data"))
  weights = np.concatenate([w for _, _, w in batches])
  assert weights.sum() == len(ds.test) and len(weights) % 64 == 0


def test_the_iterator_resumes_mid_epoch_exactly():
  """Grain's iterator state taken after any step, set on a fresh iterator of the same epoch,
  repeats the rest of the epoch bit for bit."""
  ds = data.load("digits")
  mesh = make_mesh(2)
  whole = list(input_pipeline.train_batches(ds.train, 64, mesh, "data", seed=3, epoch=2))
  first = input_pipeline.train_batches(ds.train, 64, mesh, "data", seed=3, epoch=2)
  for _ in range(5):
    next(first)
  rest = list(input_pipeline.train_batches(ds.train, 64, mesh, "data", seed=3, epoch=2,
                                           state=first.get_state()))
  assert len(rest) == len(whole) - 5
  for got, want in zip(rest, whole[5:]):
    for a, b in zip(got, want):
      np.testing.assert_array_equal(a, b)


def test_model_and_dataset_must_fit():
  with pytest.raises(ValueError, match=r"--model vgg16 reads image data; --dataset must be "
                                       r"one of \['cifar10', 'cifar100', 'digits', 'house'"):
    check_model_data("vgg16", "mnist1d")
  with pytest.raises(ValueError, match="--dataset must be one of"):
    check_model_data("bert", "c4")
  check_model_data("bert", "wikipedia/20201201.en")


def test_cifar_training_batches_are_cropped_and_flipped(tmp_path):
  mesh = make_mesh(2)
  with tfds.testing.mock_data(num_examples=8, data_dir=str(tmp_path)):
    ds = data.load("cifar10", Request(data_dir=str(tmp_path)))
    assert ds.train.augment is not None and ds.test.augment is None
    plain = ds.train.take(np.arange(8))[0]
    epochs = [np.concatenate([x for x, _, _ in input_pipeline.train_batches(
        ds.train, 8, mesh, "data", seed=0, epoch=e)]) for e in (1, 1, 2)]
  # The epoch's example order: Grain's shuffle with the epoch's seed.
  order = list(grain.MapDataset.range(8).shuffle(seed=input_pipeline.epoch_seed(0, 1)))
  x = epochs[0]
  np.testing.assert_array_equal(x, epochs[1])  # a function of (seed, epoch, index)
  assert not np.array_equal(x, epochs[2])
  for row, index in enumerate(order):
    # Each image is a shifted (up to 4 pixels, zero-filled) and maybe mirrored original.
    candidates = [np.pad(img, ((4, 4), (4, 4), (0, 0)))[dy:dy + 32, dx:dx + 32]
                  for img in (plain[index], plain[index][:, ::-1])
                  for dy in range(9) for dx in range(9)]
    assert any(np.array_equal(c, x[row]) for c in candidates)
  assert sum(not np.array_equal(x[row], plain[i]) for row, i in enumerate(order)) >= 6
