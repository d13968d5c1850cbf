"""Configuration of SparDL and the block layout every implementation agrees on.

The layout follows ``docs/DESIGN.md`` of the project: a worker's flat vector of length ``n``
is zero-padded to ``Q * m`` with ``m = ceil(n / Q)`` and cut into ``Q`` blocks of ``m``;
each block keeps ``kb = min(m, max(1, ceil(density * m)))`` entries when sparsified.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

Residuals = Literal["global", "local", "none"]
RESIDUAL_MODES = ("global", "local", "none")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparDLConfig:
  """Options of the SparDL sparse all-reduce (validated at construction).

  Attributes:
    density: fraction of each block kept by every top-k selection, in (0, 1].
      ``density=1`` makes the all-reduce exact (it then equals ``pmean``).
    teams: number of teams ``d`` the ``P`` workers are split into (contiguous
      ranks, ``d`` must divide ``P``). Only ``teams=1`` (no Spar-All-Gather) is
      implemented so far; other values raise ``NotImplementedError`` at trace time.
    residuals: which discarded gradient is carried to the next step (the paper's
      Section VI ablation). ``'global'`` (default): global residual collection (GRES),
      every discard, mass-conserving. ``'local'``: only what a worker discarded of its own
      gradient before sending (LRES, as in DGC); mass received and discarded in-procedure
      is lost. ``'none'``: no residual at all.

  References:
    Zhao et al., "SparDL: Distributed Deep Learning Training with Efficient
    Sparse Communication", ICDE 2024.
  """

  density: float
  teams: int = 1
  residuals: Residuals = "global"

  def __post_init__(self):
    density = self.density
    if isinstance(density, bool) or not isinstance(density, (int, float)):
      raise TypeError(
          f"SparDLConfig: density must be a float in (0, 1], got {density!r} "
          f"of type {type(density).__name__}.")
    if not (0.0 < float(density) <= 1.0):  # also rejects NaN
      raise ValueError(
          f"SparDLConfig: density must be in (0, 1] (the fraction of each block "
          f"kept), got {density!r}.")
    teams = self.teams
    if isinstance(teams, bool) or not isinstance(teams, int) or teams < 1:
      raise ValueError(
          f"SparDLConfig: teams must be a positive int that divides the number "
          f"of workers, got {teams!r}.")
    if self.residuals not in RESIDUAL_MODES:
      raise ValueError(f"SparDLConfig: residuals must be one of {RESIDUAL_MODES}, got "
                       f"{self.residuals!r}.")
    object.__setattr__(self, "density", float(density))


@dataclasses.dataclass(frozen=True)
class BlockLayout:
  """How a flat vector of length ``n`` is cut into ``q`` blocks for one team.

  Attributes:
    n: length of the flat vector.
    q: number of blocks (the team size Q).
    m: block length, ``ceil(n / q)``; the vector is zero-padded to ``q * m``.
    kb: entries kept per block, ``min(m, max(1, ceil(density * m)))``.
  """

  n: int
  q: int
  m: int
  kb: int

  @classmethod
  def make(cls, n: int, q: int, density: float) -> "BlockLayout":
    if n < 1:
      raise ValueError(f"the gradient must have at least one entry, got n={n}.")
    m = -(-n // q)
    kb = min(m, max(1, math.ceil(density * m)))
    return cls(n=n, q=q, m=m, kb=kb)

  @property
  def padded(self) -> int:
    """Length ``q * m`` of the zero-padded vector."""
    return self.q * self.m
