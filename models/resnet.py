"""ResNets (He et al., 2016): ResNet-50 for ImageNet (case 3) and ResNet-20 for CIFAR."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax


def _norm(train: bool, zero: bool = False) -> nn.BatchNorm:
  # The last norm of each residual branch starts at zero, so every block starts as identity.
  return nn.BatchNorm(use_running_average=not train, momentum=0.9,
                      scale_init=nn.initializers.zeros if zero else nn.initializers.ones)


class BasicBlock(nn.Module):
  """Two 3x3 convolutions (ResNet-20)."""

  features: int
  strides: int = 1

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    y = nn.Conv(self.features, (3, 3), self.strides, use_bias=False)(x)
    y = nn.relu(_norm(train)(y))
    y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
    y = _norm(train, zero=True)(y)
    if x.shape != y.shape:  # projection shortcut ("option B")
      x = _norm(train)(nn.Conv(self.features, (1, 1), self.strides, use_bias=False)(x))
    return nn.relu(x + y)


class Bottleneck(nn.Module):
  """1x1 reduce, 3x3, 1x1 expand by 4 (ResNet-50)."""

  features: int
  strides: int = 1

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    y = nn.relu(_norm(train)(nn.Conv(self.features, (1, 1), use_bias=False)(x)))
    y = nn.Conv(self.features, (3, 3), self.strides, use_bias=False)(y)
    y = nn.relu(_norm(train)(y))
    y = _norm(train, zero=True)(nn.Conv(4 * self.features, (1, 1), use_bias=False)(y))
    if x.shape != y.shape:
      x = _norm(train)(nn.Conv(4 * self.features, (1, 1), self.strides, use_bias=False)(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  """ResNet on ``(B, H, W, C)`` float32 images -> ``(B, num_classes)`` float32 logits.

  Attributes:
    num_classes: classes.
    stages: blocks per stage, e.g. ``(3, 4, 6, 3)`` for ResNet-50.
    widths: base width of each stage.
    bottleneck: bottleneck blocks (ResNet-50) or basic blocks (ResNet-20).
    imagenet_stem: a 7x7/2 convolution and a 3x3/2 max-pool (ImageNet) instead of one 3x3
      convolution (CIFAR).
  """

  num_classes: int = 1000
  stages: Sequence[int] = (3, 4, 6, 3)
  widths: Sequence[int] = (64, 128, 256, 512)
  bottleneck: bool = True
  imagenet_stem: bool = True

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
    if self.imagenet_stem:
      x = nn.Conv(self.widths[0], (7, 7), 2, use_bias=False)(x)
      x = nn.relu(_norm(train)(x))
      x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    else:
      x = nn.relu(_norm(train)(nn.Conv(self.widths[0], (3, 3), use_bias=False)(x)))
    block = Bottleneck if self.bottleneck else BasicBlock
    for i, (blocks, width) in enumerate(zip(self.stages, self.widths)):
      for j in range(blocks):
        x = block(width, strides=2 if i > 0 and j == 0 else 1)(x, train)
    return nn.Dense(self.num_classes)(x.mean(axis=(1, 2)))
