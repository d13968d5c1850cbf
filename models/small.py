"""The small models of the main job: offline data, trained in minutes on CPU."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax


class CNN1D(nn.Module):
  """1-D CNN for MNIST-1D: conv blocks with max-pooling, then an MLP head.

  Input ``(B, L)`` float32 signals; output ``(B, num_classes)`` logits.
  """

  num_classes: int = 10
  features: Sequence[int] = (32, 64, 64)
  hidden: int = 128

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
    x = x[..., None]
    for f in self.features:
      x = nn.relu(nn.Conv(f, (5,))(x))
      x = nn.max_pool(x, (2,), strides=(2,))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.num_classes)(x)


class MLP(nn.Module):
  """Multi-layer perceptron on flattened inputs ``(B, ...)`` -> ``(B, num_classes)``."""

  num_classes: int = 10
  hidden: Sequence[int] = (128,)

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
    x = x.reshape(x.shape[0], -1)
    for h in self.hidden:
      x = nn.relu(nn.Dense(h)(x))
    return nn.Dense(self.num_classes)(x)


class DotReluDot(nn.Module):
  """The model of Flax's "Scale up on multiple devices" guide: ``layers`` blocks of
  ``Dense(features) -> relu -> Dense(features)``, no biases, LeCun-normal kernels.

  Input ``(B, d)`` float32 vectors; output ``(B, features)`` (a dataset of ``features``-wide
  targets fixes it; the guide's is 1,024 wide and 2 blocks deep, 4.2M parameters).
  """

  features: int = 1024
  layers: int = 2

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
    for _ in range(self.layers):
      x = nn.Dense(self.features, use_bias=False)(x)
      x = nn.Dense(self.features, use_bias=False)(nn.relu(x))
    return x
