"""TopkA: all-gather of every worker's local top-k (a baseline of the paper).

Each worker keeps the ``k`` largest entries of ``g = x + residual`` and all-gathers them
(Bruck, ``ceil(log2 P)`` rounds); every worker sums the ``P`` sparse vectors in worker order.
Bandwidth grows with ``P`` (``2 k (P - 1)`` elements per worker): the sparse-gradient
accumulation problem SparDL avoids.

References:
  Renggli et al., "SparCML: High-Performance Sparse Communication for Machine Learning",
  SC 2019 (the all-gather variant the SparDL paper calls TopkA).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax

from spardl_jax._src.baselines.common import (Baseline, ResidualState, allgather, check_local, densify,
                                         local_topk, topk_count)
from spardl_jax._src.core import messages, protocol
from spardl_jax._src.core.config import DensityConfig

__all__ = ['TopkAConfig', 'formula', 'topka_allreduce', 'paper', 'TopkA']


@dataclasses.dataclass(frozen=True, kw_only=True)
class TopkAConfig(DensityConfig):
  """``density``: fraction ``k / n`` of the local gradient each worker sends, in (0, 1]."""



def formula(p: int, n: int, config: TopkAConfig, itemsize: int = 4) -> protocol.Cost:
  """Per-worker ``rounds`` and ``bytes`` sent: ``ceil(log2 P)``, ``k (P - 1)`` pairs."""
  k = topk_count(config.density, n)
  return protocol.Cost((p - 1).bit_length(), k * (p - 1) * (4 + itemsize))


def topka_allreduce(x: jax.Array, state: ResidualState, config: TopkAConfig, *,
                    axis_name) -> tuple[jax.Array, ResidualState]:
  """Mean over ``axis_name`` of every worker's local top-k; inside ``shard_map``.

  Args:
    x: ``(n,)`` float local gradient; state: its :class:`ResidualState`.

  Returns:
    ``(y, state)``: ``y`` ``(n,)`` bit-identical on every worker; the new residual is
    ``g`` without the entries this worker sent (no mass lost).
  """
  check_local("topka_allreduce", x, state.residual)
  p = jax.lax.axis_size(axis_name)
  n = x.shape[0]
  k = topk_count(config.density, n)
  g = x + state.residual
  offsets, values = local_topk(g, k)
  rows = allgather(messages.pack(offsets[None], values[None]), axis_name)
  all_off, all_val = messages.unpack(rows, k, x.dtype)
  y = densify(n, all_off, all_val, x.dtype) / p
  return y, ResidualState(g.at[offsets].set(0))


def paper(p: int, n: int, k: int) -> protocol.PaperCost:
  """The paper's Table 1: ``log P`` rounds, ``2 (P - 1) k`` elements."""
  del n
  return protocol.PaperCost(math.log2(p) if p > 1 else 0.0, (2 * (p - 1) * k,) * 2)


@protocol.register
@dataclasses.dataclass(frozen=True)
class TopkA(Baseline):
  """all-gather of local top-k as a registered all-reduce (options: :class:`TopkAConfig`)."""

  name: ClassVar[str] = "topka"
  summary: ClassVar[str] = "all-gather of local top-k"
  Config: ClassVar[type] = TopkAConfig
  config: TopkAConfig
  allreduce = staticmethod(topka_allreduce)
  cost = staticmethod(formula)
  paper = staticmethod(paper)
