"""VGG (Simonyan & Zisserman, 2015) for small images: the paper's cases 1, 2 and 4.

The CIFAR form of VGG: 3x3 convolutions with batch normalization, five 2x2 max-pools, and one
dense layer on the flattened features (no 4096-wide classifier, which only exists for 224x224
ImageNet inputs). This is the form whose sizes match the paper: VGG-16 on CIFAR-10 has 14.7M
parameters, VGG-19 on CIFAR-100 20.1M, VGG-11 with one regression output 9.2M.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax

# Output channels of each 3x3 convolution; "M" is a 2x2 max-pool.
LAYERS: dict[int, tuple] = {
    11: (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    16: (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512,
         "M"),
    19: (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512,
         512, 512, 512, "M"),
}


class VGG(nn.Module):
  """VGG on ``(B, H, W, C)`` float32 images -> ``(B, num_classes)`` float32 outputs.

  Attributes:
    num_classes: outputs (1 for regression).
    layers: conv widths and ``"M"`` pools, e.g. ``LAYERS[16]``.
    width: multiplies every conv width (tiny configurations use 1/16).
  """

  num_classes: int = 10
  layers: Sequence = LAYERS[16]
  width: float = 1.0

  @nn.compact
  def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
    for layer in self.layers:
      if layer == "M":
        # Pools stop at 1x1, so the small images of tests and demos fit every depth.
        if x.shape[1] > 1:
          x = nn.max_pool(x, (2, 2), strides=(2, 2))
        continue
      x = nn.Conv(max(1, int(layer * self.width)), (3, 3), use_bias=False)(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
      x = nn.relu(x)
    return nn.Dense(self.num_classes)(x.reshape(x.shape[0], -1))
