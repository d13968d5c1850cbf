"""Model names on the command line -> Flax modules, each with a full and a tiny size.

The full sizes are the paper's (Table 2 and Section V-A: 14.7M, 20.1M, 23.5M, 9.2M, 35.2M,
66M and 133.5M parameters); :data:`MODELS` records each paper figure beside ours and why they
differ where they do. Tiny sizes have the same structure at a few thousand parameters, for
tests and CPU demos.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Literal, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models import bert, gpt, lstm, resnet, small, vgg

Size = Literal["full", "tiny"]
SIZES: tuple[str, ...] = typing.get_args(Size)

# What a model reads; each dataset has one of these kinds (train/input_pipeline.py).
Kind = Literal["image", "signal", "text", "corpus", "vector"]


class Paper(NamedTuple):
  """The paper's parameter count for a model and how ours relates to it.

  ``ours + adjust`` is the paper's count to 0.5 % (``tests/trainer/test_models.py`` checks it).
  """

  params: float
  adjust: int = 0
  why: str = ""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """One model name.

  Attributes:
    cls: the Flax module class.
    full, tiny: its keyword arguments at each size.
    inputs: the dataset kinds it reads.
    objective: on a text corpus, ``"lm"`` (next token) or ``"mlm"`` (masked tokens).
    example: ``(shape, dtype)`` of one full-size input example, for ``--describe``.
    paper: the paper's parameter count and how ours relates to it (None for models the
      paper does not train).
  """

  cls: type[nn.Module]
  full: dict
  tiny: dict
  inputs: tuple[Kind, ...]
  example: tuple[tuple[int, ...], type]
  objective: Literal["lm", "mlm", None] = None
  paper: Paper | None = None


_IMAGES = ("image",)
MODELS: dict[str, ModelSpec] = {
    "vgg11": ModelSpec(vgg.VGG, dict(layers=vgg.LAYERS[11], num_classes=1),
                       dict(layers=vgg.LAYERS[11], width=1 / 16), _IMAGES,
                       ((64, 64, 3), np.float32),
                       paper=Paper(9.2e6, why="one regression output; input: 2x2 montages of the "
                                              "four 32x32 photos of a house")),
    "vgg16": ModelSpec(vgg.VGG, dict(layers=vgg.LAYERS[16]),
                       dict(layers=vgg.LAYERS[16], width=1 / 16), _IMAGES,
                       ((32, 32, 3), np.float32),
                       paper=Paper(14.7e6, -4224, "batch norm in place of conv biases adds 4,224")),
    "vgg19": ModelSpec(vgg.VGG, dict(layers=vgg.LAYERS[19], num_classes=100),
                       dict(layers=vgg.LAYERS[19], width=1 / 16), _IMAGES,
                       ((32, 32, 3), np.float32),
                       paper=Paper(20.1e6, -5504, "batch norm in place of conv biases adds 5,504")),
    "resnet20": ModelSpec(resnet.ResNet, dict(num_classes=10, stages=(3, 3, 3),
                                              widths=(16, 32, 64), bottleneck=False,
                                              imagenet_stem=False),
                          dict(num_classes=10, stages=(1, 1, 1), widths=(4, 8, 8),
                               bottleneck=False, imagenet_stem=False), _IMAGES,
                          ((32, 32, 3), np.float32)),
    "resnet50": ModelSpec(resnet.ResNet, dict(), dict(stages=(1, 1, 1, 1), widths=(4, 4, 8, 8)),
                          _IMAGES, ((224, 224, 3), np.float32),
                          paper=Paper(23.5e6, -2_049_000, "23.5M is the network without its "
                                                        "1000-way classifier (2,049,000)")),
    "lstm_imdb": ModelSpec(lstm.LSTMClassifier, dict(),
                           dict(vocab_size=256, embed=16, hidden=16), ("text",),
                           ((256,), np.int32),
                           paper=Paper(35.2e6, why="vocabulary 40,000 x 512, 1024 units (the "
                                                   "paper does not give its sizes)")),
    "lstm_ptb": ModelSpec(lstm.LSTMLanguageModel, dict(),
                          dict(vocab_size=256, hidden=32, dropout_rate=0.0), ("corpus",),
                          ((35,), np.int32), objective="lm",
                          paper=Paper(66e6, why="Zaremba et al.'s large model")),
    "bert": ModelSpec(bert.BertMLM, dict(vocab_size=30_522, hidden=768, layers=12, heads=12,
                                         ffn=3072, max_len=512),
                      dict(vocab_size=256, hidden=32, layers=2, heads=2, ffn=64, max_len=128,
                           dropout_rate=0.0), ("corpus",), ((128,), np.int32),
                      objective="mlm",
                      paper=Paper(133.5e6, 592_130, "BERT-base with an untied MLM output "
                                                    "layer; the next-sentence head (592,130) "
                                                    "is left out")),
    "gpt": ModelSpec(gpt.GPT, dict(vocab_size=50_257, hidden=768, layers=12, heads=12,
                                   ffn=3072, max_len=1024),
                     dict(vocab_size=256, hidden=32, layers=2, heads=2, ffn=64, max_len=128,
                          dropout_rate=0.0), ("corpus",), ((128,), np.int32), objective="lm"),
    # nanoGPT's "baby GPT" as its README trains it on a CPU (4 layers, 4 heads, 128 wide,
    # context 64, no dropout, no biases, N(0, 0.02) weights): what a new user's AdamW run is.
    "nanogpt": ModelSpec(gpt.GPT, dict(vocab_size=65, hidden=128, layers=4, heads=4, ffn=512,
                                       max_len=64, dropout_rate=0.0, bias=False,
                                       init_std=0.02),
                         dict(vocab_size=65, hidden=16, layers=2, heads=2, ffn=32, max_len=64,
                              dropout_rate=0.0, bias=False, init_std=0.02), ("corpus",),
                         ((64,), np.int32), objective="lm"),
    # Flax's multi-device guide's model: what a user of that guide trains with AdamW.
    "dotrelu": ModelSpec(small.DotReluDot, dict(), dict(features=64), ("vector",),
                         ((1024,), np.float32)),
    "cnn1d": ModelSpec(small.CNN1D, dict(), dict(features=(8, 8), hidden=16), ("signal",),
                       ((40,), np.float32)),
    "mlp": ModelSpec(small.MLP, dict(hidden=(128,)), dict(hidden=(16,)),
                     ("image", "signal"), ((8, 8), np.float32)),
    # Little compute per parameter (one multiply-add per example), a 4.3M-entry gradient:
    # the time-to-accuracy benchmark's case, where the network decides
    # (benchmarks/results/network.md).
    "mlp_wide": ModelSpec(small.MLP, dict(hidden=(2048, 2048)), dict(hidden=(32, 32)),
                          ("image", "signal"), ((8, 8), np.float32)),
}


def spec(name: str) -> ModelSpec:
  """The :class:`ModelSpec` of ``name``; a ValueError lists the names."""
  if name not in MODELS:
    raise ValueError(f"--model must be one of {sorted(MODELS)}, got {name!r}.")
  return MODELS[name]


def create(name: str, size: Size = "full", **data) -> nn.Module:
  """The model ``name`` at ``size``, shaped for a dataset.

  Args:
    name: a key of :data:`MODELS`.
    size: ``"full"`` or ``"tiny"``.
    **data: what the dataset fixes, e.g. ``num_classes=100`` or ``vocab_size=10_000``;
      fields the model does not have are ignored (a classifier has no vocabulary).
  """
  s = spec(name)
  if size not in SIZES:
    raise ValueError(f"--model-size must be 'full' or 'tiny', got {size!r}.")
  fields = {f.name for f in dataclasses.fields(s.cls)}
  kwargs = {**(s.full if size == "full" else s.tiny),
            **{k: v for k, v in data.items() if k in fields and v is not None}}
  return s.cls(**kwargs)


def abstract_params(model: nn.Module, example: tuple[tuple[int, ...], type]):
  """The parameter tree as ShapeDtypeStructs: no memory, no compute."""
  shape, dtype = example
  variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, *shape), dtype))
  return variables["params"]


def count(params) -> int:
  """Number of parameters in a tree of arrays or ShapeDtypeStructs."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def _natural(key: str):
  """``EncoderLayer_10`` after ``EncoderLayer_9``."""
  return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def describe(name: str, size: Size = "full") -> str:
  """A layer summary (one row per top-level module) and the parameter count of ``name``."""
  s = spec(name)
  model = create(name, size)
  params = abstract_params(model, s.example)
  rows = []
  for layer in sorted(params, key=_natural):
    leaves = jax.tree.leaves(params[layer])
    largest = max(leaves, key=lambda a: int(np.prod(a.shape)))
    rows.append((layer, count(params[layer]), len(leaves), tuple(largest.shape)))
  width = max(len(r[0]) for r in rows)
  header = f"  {'layer':<{width}}  {'parameters':>12}  {'tensors':>7}  largest"
  lines = [f"{name} ({size}): {model.__class__.__name__}, input {s.example[0]} "
           f"{np.dtype(s.example[1]).name}", "", header]
  lines += [f"  {layer:<{width}}  {n:>12,}  {t:>7}  {shape}" for layer, n, t, shape in rows]
  total = count(params)
  lines += ["", f"  total parameters: {total:,} ({total / 1e6:.1f}M)"]
  if s.paper and size == "full":
    lines.append(f"  paper (Section V-A): {s.paper.params / 1e6:.1f}M"
                 + (f"; {s.paper.why}" if s.paper.why else ""))
  return "\n".join(lines)
