"""The House dataset (Ahmed & Moustafa, 2016) for VGG-11 price regression (case 4).

``--data-dir`` holds the dataset as published: ``HousesInfo.txt``, one house per line with
bedrooms, bathrooms, area, zip code and price (space or comma separated), and four photos
per house, ``{i}_bathroom.jpg``, ``{i}_bedroom.jpg``, ``{i}_frontal.jpg``,
``{i}_kitchen.jpg`` for house ``i`` (line ``i``, from 1). Each house becomes one 64x64 image,
a 2x2 montage of its photos at 32x32, and its target is the price divided by the largest
training price; 20 % of the houses (a seeded choice) are the test set.
"""

from __future__ import annotations

import os

import numpy as np

from train.data.types import Dataset, Request, array_split

ROOMS = ("bathroom", "bedroom", "frontal", "kitchen")
TILE = 32


def read_info(path: str) -> np.ndarray:
  """``(houses, 5)`` float64: bedrooms, bathrooms, area, zip code, price."""
  with open(path, encoding="utf-8") as f:
    rows = [line.replace(",", " ").split() for line in f if line.strip()]
  bad = [i + 1 for i, r in enumerate(rows) if len(r) != 5]
  if bad:
    raise ValueError(f"{path}: lines {bad[:5]} do not have 5 fields (bedrooms bathrooms area "
                     f"zipcode price).")
  return np.array(rows, np.float64)


def montage(data_dir: str, house: int) -> np.ndarray:
  """``(64, 64, 3)`` uint8: the four photos of ``house`` (from 1) in a 2x2 grid."""
  from PIL import Image

  out = np.zeros((2 * TILE, 2 * TILE, 3), np.uint8)
  for i, room in enumerate(ROOMS):
    with Image.open(os.path.join(data_dir, f"{house}_{room}.jpg")) as img:
      tile = np.asarray(img.convert("RGB").resize((TILE, TILE), Image.BILINEAR))
    r, c = divmod(i, 2)
    out[r * TILE:(r + 1) * TILE, c * TILE:(c + 1) * TILE] = tile
  return out


def load(req: Request) -> Dataset:
  """The House dataset from ``req.data_dir`` (see the module docstring)."""
  path = os.path.join(req.data_dir or "", "HousesInfo.txt")
  if not req.data_dir or not os.path.exists(path):
    raise FileNotFoundError(
        f"--dataset house reads HousesInfo.txt and the house photos from --data-dir "
        f"(missing: {path!r}); get them from https://github.com/emanhamed/Houses-dataset.")
  price = read_info(path)[:, 4]
  x = np.stack([montage(req.data_dir, i + 1) for i in range(len(price))])
  x = (x.astype(np.float32) / 255 - 0.5) / 0.25
  order = np.random.default_rng(req.seed).permutation(len(price))
  cut = len(order) // 5
  test, train = order[:cut], order[cut:]
  y = (price / price[train].max()).astype(np.float32)
  return Dataset("house", "image", "regress", array_split(x[train], y[train]),
                 array_split(x[test], y[test]), {"num_classes": 1})


SOURCES = {"house": ("image", load)}
