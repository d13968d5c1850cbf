"""Dense ``pmean``: the reference every sparse all-reduce is measured against."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from spardl_jax.core import protocol


def formula(p: int, n: int, itemsize: int = 4) -> dict:
  """A ring all-reduce: ``2 (P - 1)`` rounds, ``2 (P - 1) / P * n`` elements per device."""
  return {"rounds": 2 * (p - 1), "bytes": 2 * (p - 1) * n * itemsize // p}


@protocol.register
@dataclasses.dataclass(frozen=True)
class Dense:
  """``jax.lax.pmean`` (an XLA all-reduce), with no state and no options."""

  name: ClassVar[str] = "dense"
  summary: ClassVar[str] = "pmean (ring all-reduce)"
  Config: ClassVar[None] = None
  nonfinite_reaches_result: ClassVar[bool] = True  # a sum with a NaN or inf is not finite
  config: None = None

  def init(self, *, n: int, dtype, p: int) -> tuple:
    del n, dtype, p
    return ()

  def apply(self, x, state, *, axis_name):
    return jax.lax.pmean(x, axis_name), state

  def formula(self, *, p: int, n: int, itemsize: int) -> dict:
    return formula(p, n, itemsize)

  def stats(self, *, n: int, p: int, itemsize: int, state, rank):
    del state, rank
    return formula(p, n, itemsize)["bytes"], 0
