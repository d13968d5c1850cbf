"""The paper's models: full sizes against the paper's parameter counts, tiny sizes run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import MODELS, count, create, describe
from models.registry import abstract_params
from train import main

# Our exact full-size counts (the paper's, and why they differ, are in MODELS[name].paper).
FULL = {"vgg11": 9_225_281, "vgg16": 14_724_042, "vgg19": 20_081_188, "resnet20": 272_474,
        "resnet50": 25_557_032, "lstm_imdb": 35_170_306, "lstm_ptb": 66_022_000,
        "bert": 132_955_194, "gpt": 124_439_808, "cnn1d": 73_418, "mlp": 9_610,
        "mlp_wide": 4_349_962, "dotrelu": 4_194_304,
        # nanoGPT's baby GPT, as its model.py counts it with no biases: 4 layers of 12 * 128^2
        # weights and two norm scales, the final norm, 65 x 128 tokens and 64 x 128 positions.
        "nanogpt": 4 * (12 * 128**2 + 2 * 128) + 128 + 65 * 128 + 64 * 128}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_full_size_matches_the_paper(name):
  spec = MODELS[name]
  n = count(abstract_params(create(name), spec.example))
  assert n == FULL[name]
  if spec.paper:
    assert abs(n + spec.paper.adjust - spec.paper.params) <= 0.005 * spec.paper.params


# VGG-11 and VGG-19 are VGG-16's class with other layer lists (their sizes are checked above);
# compiling each costs about 5 s on two cores. ResNet-20 trains, batch norm included, in
# tests/trainer/test_train.py::test_every_task_trains.
@pytest.mark.parametrize("name", sorted(set(MODELS) - {"vgg11", "vgg19", "resnet20"}))
def test_tiny_size_runs_in_train_mode(name):
  spec = MODELS[name]
  model = create(name, "tiny")
  shape, dtype = spec.example
  shape = (32, 32, 3) if name == "resnet50" else shape  # the tiny one takes any size
  x = (jnp.ones((2, *shape), dtype) if dtype == np.int32 else
       jax.random.normal(jax.random.key(0), (2, *shape), dtype))

  @jax.jit  # one compilation for both
  def init_and_apply(x):
    variables = model.init(jax.random.key(0), x)
    return variables, model.apply(variables, x, train=True, mutable=["batch_stats"],
                                  rngs={"dropout": jax.random.key(1)})

  variables, (out, updates) = init_and_apply(x)
  assert count(variables["params"]) < 100_000
  if spec.objective:  # per-token logits
    assert out.shape == (2, shape[0], model.vocab_size)
  else:  # class logits, or the regression's features
    assert out.shape == (2, getattr(model, "num_classes", getattr(model, "features", 10)))
  assert bool(jnp.all(jnp.isfinite(out)))
  # Batch-norm models update their statistics in training, the others have none.
  has_bn = name.startswith(("vgg", "resnet"))
  assert bool(updates) == has_bn


def test_dataset_fixes_the_output_size():
  assert create("vgg19", num_classes=7).num_classes == 7
  assert create("lstm_ptb", vocab_size=85).vocab_size == 85
  assert not hasattr(create("vgg16", vocab_size=3), "vocab_size")  # ignored


def test_describe_cli_prints_the_summary_without_training(capsys):
  assert main.main(["--model", "lstm_ptb", "--describe"]) == 0
  out = capsys.readouterr().out
  assert "total parameters: 66,022,000 (66.0M)" in out
  assert "paper (Section V-A): 66.0M" in out
  assert "_StackedLSTM_0" in out
  assert "(1500, 10000)" in out  # the output layer, the largest tensor of Dense_0
  assert describe("bert").count("EncoderLayer_") == 12


def test_unknown_model_is_a_clear_error():
  with pytest.raises(ValueError, match=r"--model must be one of \['bert', .*got 'vgg13'"):
    create("vgg13")
  with pytest.raises(ValueError, match="--model-size must be 'full' or 'tiny'"):
    create("vgg16", "small")
