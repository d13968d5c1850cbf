"""Training configuration: the defaults are the main job (MNIST-1D, 8 devices, dense vs SparDL 1 %)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Variant:
  """One gradient-sync method to train with.

  Attributes:
    label: the name in tables and plots, e.g. ``spardl:density=0.001``.
    method: a name from :data:`spardl_jax.methods.METHODS`.
    options: the method's options (``density``, ``teams``, ``residuals`` for SparDL).
  """

  label: str
  method: str
  options: dict


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  model: str = "cnn1d"
  model_size: str = "full"
  dataset: str = "mnist1d"
  variants: tuple[Variant, ...] = ()
  devices: int = 8
  epochs: int = 30
  batch_size: int = 128
  lr: float = 0.05
  momentum: float = 0.9
  seed: int = 0
  out: str = "train_out"
  axis_name: str = "data"


def parse_teams(text: str):
  """``--teams`` value: an int or ``'auto'``."""
  return text if text == "auto" else int(text)


def parse_variant(text: str, *, density: float, teams, sag: str, residuals: str) -> Variant:
  """``method[:key=value[:key=value...]]`` -> :class:`Variant`.

  Options not given in ``text`` come from the command line: ``--density`` for every
  sparse method, and ``--teams``, ``--sag`` and ``--residuals`` for SparDL. Baselines take
  their own keys (``capacity``, ``tau``, ``tau_regions``; see :mod:`spardl_jax.methods`).
  """
  method, *pairs = text.split(":")
  options = {}
  if method == "spardl":
    options = {"density": density, "teams": teams, "sag": sag, "residuals": residuals}
  elif method != "dense":  # the baselines
    options = {"density": density}
  casts = {"density": float, "teams": parse_teams, "sag": str, "residuals": str,
           "capacity": float, "tau": int, "tau_regions": int}
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep or key not in casts:
      raise ValueError(f"--compare: {pair!r} in {text!r} is not key=value with key one of "
                       f"{sorted(casts)}.")
    options[key] = casts[key](value)
  return Variant(text, method, options)
