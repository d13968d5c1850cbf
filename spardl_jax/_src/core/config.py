"""Configuration of SparDL and the block layout every implementation agrees on.

The layout follows ``docs/design.md`` of the project: a worker's flat vector of length ``n``
is zero-padded to ``Q * m`` with ``m = ceil(n / Q)`` and cut into ``Q`` blocks of ``m``;
each block keeps ``kb = min(m, max(1, ceil(density * m)))`` entries when sparsified.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

__all__ = ['Residuals', 'Sag', 'WireFormat', 'RESIDUAL_MODES', 'SAG_MODES', 'WIRE_FORMATS',
           'ETHERNET_10G', 'INFINIBAND_100G', 'SparDLConfig', 'DensityConfig', 'check_density',
           'check_positive', 'check_number', 'as_float', 'SUPPORTED_DTYPES', 'check_dtype',
           'Blocks']

Residuals = Literal["global", "local", "none"]
RESIDUAL_MODES = ("global", "local", "none")
Sag = Literal["auto", "recursive", "bruck"]
SAG_MODES = ("auto", "recursive", "bruck")
WireFormat = Literal["exact", "compact", "int8", "int4", "int2"]
WIRE_FORMATS = ("exact", "compact", "int8", "int4", "int2")
# Alpha-beta parameters of two networks: latency per round (s) and seconds per byte.
ETHERNET_10G = {"alpha": 50e-6, "beta": 1 / 1.25e9}
INFINIBAND_100G = {"alpha": 2e-6, "beta": 1 / 12.5e9}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparDLConfig:
  """Options of the SparDL sparse all-reduce (validated at construction).

  Attributes:
    density: fraction of each block kept by every top-k selection, in (0, 1].
      ``density=1`` makes the all-reduce exact (it then equals ``pmean``).
    teams: number of teams ``d`` the ``P`` workers are split into (contiguous
      ranks, ``d`` must divide ``P``; checked at trace time). ``1``: SRS + Bruck, no
      Spar-All-Gather. ``'auto'``: the ``d`` with the least modeled time
      ``rounds * alpha + bytes * beta`` (:func:`spardl_jax._src.core.cost.choose_teams`).
    sag: the Spar-All-Gather for ``teams > 1``: ``'recursive'`` (R-SAG, ``d`` a power of
      two), ``'bruck'`` (B-SAG with the adaptive ``h``, any ``d``) or ``'auto'`` (R-SAG when
      ``d`` is a power of two, else B-SAG).
    alpha: latency per round in seconds, for ``teams='auto'`` (default: 10 Gbit/s Ethernet).
    beta: seconds per byte, for ``teams='auto'`` (default 1 / 1.25 GB/s).
    residuals: which discarded gradient is carried to the next step (the paper's
      Section VI ablation). ``'global'`` (default): global residual collection (GRES),
      every discard, mass-conserving. ``'local'``: only what a worker discarded of its own
      gradient before sending (LRES, as in DGC); mass received and discarded in-procedure
      is lost. ``'none'``: no residual at all.
    wire: the message format (:class:`~spardl_jax._src.core.messages.Wire`). ``'compact'``
      (default): 16-bit offsets (plus a count per 65,536 offsets of a block) and bfloat16
      values, about half the bytes of ``'exact'`` for float32 gradients; each sender keeps
      the rounding error of the values it sends in its residual, so no gradient mass is
      lost (float16 and bfloat16 values travel unchanged). ``'exact'``: int32 offsets and
      values in the gradient's dtype, the paper's format. ``'int8'``, ``'int4'``,
      ``'int2'``: the compact offsets with ``b``-bit integer values and one power-of-two
      scale per block (SparseLoCo sends 2-bit values); the rounding error stays in the
      sender's residual as for ``'compact'``, so with ``residuals='global'`` nothing is
      lost, only delayed.

  References:
    Zhao et al., "SparDL: Distributed Deep Learning Training with Efficient
    Sparse Communication", ICDE 2024.
  """

  density: float
  teams: int | Literal["auto"] = 1
  sag: Sag = "auto"
  residuals: Residuals = "global"
  wire: WireFormat = "compact"
  alpha: float = ETHERNET_10G["alpha"]
  beta: float = ETHERNET_10G["beta"]

  def __post_init__(self):
    check_density(self)
    teams = self.teams
    if teams != "auto":
      teams = check_number("SparDLConfig", "teams", teams,
                           "a positive int that divides the number of workers, or 'auto'",
                           integral=True, accept=lambda t: t >= 1)
      object.__setattr__(self, "teams", teams)
    if self.sag not in SAG_MODES:
      raise ValueError(f"SparDLConfig: sag must be one of {SAG_MODES}, got {self.sag!r}.")
    if self.sag == "recursive" and isinstance(teams, int) and teams & (teams - 1):
      raise ValueError(f"SparDLConfig: sag='recursive' (R-SAG) needs teams to be a power of "
                       f"two, got teams={teams}; use sag='bruck' or 'auto'.")
    check_positive(self, "alpha")
    check_positive(self, "beta")
    if self.residuals not in RESIDUAL_MODES:
      raise ValueError(f"SparDLConfig: residuals must be one of {RESIDUAL_MODES}, got "
                       f"{self.residuals!r}.")
    if self.wire not in WIRE_FORMATS:
      raise ValueError(f"SparDLConfig: wire must be one of {WIRE_FORMATS}, got {self.wire!r}.")
    object.__setattr__(self, "density", as_float(self.density))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DensityConfig:
  """Options of a baseline that keeps a fraction ``density`` of the entries, in (0, 1].

  Each baseline's config subclasses it (adding its own options), so errors name it.
  """

  density: float

  def __post_init__(self):
    check_density(self)
    object.__setattr__(self, "density", as_float(self.density))


def check_density(config) -> None:
  """Raises a clear error unless ``config.density`` is a number in (0, 1]."""
  name, density = type(config).__name__, config.density
  if isinstance(density, (bool, np.bool_)) or not isinstance(density, numbers.Real):
    raise TypeError(f"{name}: density must be a float in (0, 1], got {density!r} of type "
                    f"{type(density).__name__}.")
  if not (0.0 < float(density) <= 1.0):  # also rejects NaN
    raise ValueError(f"{name}: density must be in (0, 1] (the fraction of entries kept), "
                     f"got {density!r}.")


def check_number(who: str, name: str, value, allowed: str, *, integral: bool = False,
                 accept: Callable[[Any], bool] = lambda value: True) -> Any:
  """``value`` as a plain Python int (``integral``) or float, or a ValueError
  ``"{who}: {name} must be {allowed}, got {value!r}."`` unless it is a number of that kind
  for which ``accept`` holds. NumPy scalars count (``np.float32(0.1)`` is a real and becomes
  0.1, ``np.int64(4)`` an integral); booleans never do, and a NaN fails every comparison
  ``accept`` makes."""
  kind = numbers.Integral if integral else numbers.Real
  fits = not isinstance(value, (bool, np.bool_)) and isinstance(value, kind) and accept(value)
  if not fits:
    raise ValueError(f"{who + ': ' if who else ''}{name} must be {allowed}, got {value!r}.")
  return int(value) if integral else as_float(value)


def check_positive(config, name: str, kind=numbers.Real) -> None:
  """Raises a clear error unless ``config.<name>`` is a positive number of type ``kind``,
  and stores it as the plain Python number (:func:`check_number`)."""
  object.__setattr__(config, name, check_number(
      type(config).__name__, name, getattr(config, name), "positive",
      integral=kind is numbers.Integral, accept=lambda value: value > 0))


def as_float(value) -> float:
  """A real number as a Python float; a NumPy float by its shortest decimal form, so
  ``np.float32(0.1)`` is 0.1 (not 0.10000000149...: ``kb`` would round differently)."""
  return float(str(value)) if isinstance(value, np.floating) else float(value)


# Selection keys are the float32 bits of |value| (core/topk.py): exact for these dtypes only.
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


def check_dtype(name: str, dtype, *, who: str = "spardl") -> None:
  """Raises a clear error unless ``dtype`` is one the selection is exact in."""
  if np.dtype(dtype).name not in SUPPORTED_DTYPES:
    extra = (" float64 is rejected because selection keys are float32 bits, which would "
             "make its top-k inexact; cast the gradients to float32"
             if np.dtype(dtype) == np.float64 else "")
    raise TypeError(f"{who}: {name} must have one of the dtypes {SUPPORTED_DTYPES}, got "
                    f"{np.dtype(dtype).name}.{extra}")


@dataclasses.dataclass(frozen=True)
class Blocks:
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
  def make(cls, n: int, q: int, density: float) -> "Blocks":
    if n < 1:
      raise ValueError(f"the gradient must have at least one entry, got n={n}.")
    m = -(-n // q)
    kb = min(m, max(1, math.ceil(density * m)))
    return cls(n=n, q=q, m=m, kb=kb)

  @property
  def padded(self) -> int:
    """Length ``q * m`` of the zero-padded vector."""
    return self.q * self.m
