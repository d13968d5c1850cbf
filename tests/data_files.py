"""Small stand-ins for datasets read from files (PTB text files, the House dataset)."""

import os

import numpy as np

PTB_TRAIN = ["the cat sat on the mat", "a dog sat on a <unk>", "the dog ran"]
PTB_TEST = ["the cat ran", "a bird sat"]


def write_ptb(directory) -> None:
  """``ptb.train.txt`` and ``ptb.test.txt`` with Mikolov's layout (a leading space per line)."""
  for split, lines in (("train", PTB_TRAIN), ("test", PTB_TEST)):
    with open(os.path.join(directory, f"ptb.{split}.txt"), "w") as f:
      f.writelines(f" {line} \n" for line in lines)


def write_house(directory, houses: int = 10, seed: int = 0) -> np.ndarray:
  """``HousesInfo.txt`` and four JPEG photos per house; returns the prices."""
  from PIL import Image

  rng = np.random.default_rng(seed)
  prices = rng.integers(50_000, 900_000, houses)
  with open(os.path.join(directory, "HousesInfo.txt"), "w") as f:
    for i, price in enumerate(prices):
      f.write(f"{i % 5 + 1} {i % 3 + 1} {1000 + 10 * i} 9{i:04d} {price}\n")
  for i in range(houses):
    for room in ("bathroom", "bedroom", "frontal", "kitchen"):
      pixels = rng.integers(0, 256, (40 + i, 48, 3), dtype=np.uint8)
      Image.fromarray(pixels).save(os.path.join(directory, f"{i + 1}_{room}.jpg"))
  return prices
