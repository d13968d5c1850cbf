"""Model names on the command line -> Flax modules, with a full and a tiny size."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import flax.linen as nn

from models import small

Size = Literal["full", "tiny"]

# name -> (full, tiny) factories taking num_classes.
MODELS: dict[str, tuple[Callable[[int], nn.Module], Callable[[int], nn.Module]]] = {
    "cnn1d": (lambda c: small.CNN1D(num_classes=c),
              lambda c: small.CNN1D(num_classes=c, features=(8, 8), hidden=16)),
    "mlp": (lambda c: small.MLP(num_classes=c, hidden=(128,)),
            lambda c: small.MLP(num_classes=c, hidden=(16,))),
}


def create(name: str, num_classes: int, size: Size = "full") -> nn.Module:
  """The model ``name`` for ``num_classes`` outputs.

  Raises:
    ValueError: for an unknown name or size.
  """
  if name not in MODELS:
    raise ValueError(f"--model must be one of {sorted(MODELS)}, got {name!r}.")
  if size not in ("full", "tiny"):
    raise ValueError(f"model size must be 'full' or 'tiny', got {size!r}.")
  return MODELS[name][size == "tiny"](num_classes)
