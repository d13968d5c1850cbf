"""gTopk: a global top-k by tree reduction, then a broadcast (a baseline of the paper).

Each worker keeps its local top-``k``. In ``ceil(log2 P)`` rounds the workers merge pairwise
up a binomial tree (round ``j``: rank ``w`` with ``w mod 2^(j+1) = 2^j`` sends its ``k`` pairs
to ``w - 2^j``, which sums and keeps the top-``k``), then rank 0 broadcasts the result down
the same tree. Works for any ``P`` (the published code needs a power of two). Unlike the
published code, the entries a merge discards go to the merging worker's residual, so no
gradient mass is lost.

References:
  Shi et al., "A Distributed Synchronous SGD Algorithm with Global Top-k Sparsification for
  Low Bandwidth Networks", ICDCS 2019.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp

from spardl_jax._src.baselines.common import (Baseline, ResidualState, check_local, local_topk,
                                         topk_count)
from spardl_jax._src.core import messages, protocol
from spardl_jax._src.core.config import DensityConfig
from spardl_jax._src.core.sparse import INVALID, merge_with_partner

__all__ = ['GTopkConfig', 'reduce_pairs', 'formula', 'gtopk_allreduce', 'paper', 'GTopk']


@dataclasses.dataclass(frozen=True, kw_only=True)
class GTopkConfig(DensityConfig):
  """``density``: fraction ``k / n`` kept by every selection, in (0, 1]."""



def reduce_pairs(p: int, j: int) -> list[tuple[int, int]]:
  """Round ``j`` of the reduction: ``(sender, receiver)`` pairs."""
  s = 2**j
  return [(w, w - s) for w in range(p) if w % (2 * s) == s]


def formula(p: int, n: int, config: GTopkConfig, itemsize: int = 4) -> protocol.Cost:
  """``rounds`` = 2 ceil(log2 P); ``bytes`` = what each rank sends (rank 0 the most)."""
  k = topk_count(config.density, n)
  levels = (p - 1).bit_length()
  sends = [0] * p
  for j in range(levels):
    for sender, receiver in reduce_pairs(p, j):
      sends[sender] += 1      # up the tree
      sends[receiver] += 1    # and the broadcast back down the same edge
  per_device = [c * k * (4 + itemsize) for c in sends]
  return protocol.Cost(2 * levels, max(per_device), tuple(per_device))


def gtopk_allreduce(x: jax.Array, state: ResidualState, config: GTopkConfig, *,
                    axis_name) -> tuple[jax.Array, ResidualState]:
  """Mean over ``axis_name`` of the global top-k found by tree merges; inside ``shard_map``.

  Returns:
    ``(y, state)``: ``y`` ``(n,)`` with at most ``k`` non-zeros, bit-identical on every
    worker; the residual keeps everything this worker did not send or a merge discarded.
  """
  check_local("gtopk_allreduce", x, state.residual)
  p = jax.lax.axis_size(axis_name)
  n = x.shape[0]
  k = topk_count(config.density, n)
  rank = jax.lax.axis_index(axis_name)
  g = x + state.residual
  offsets, values = local_topk(g, k)
  residual = g.at[offsets].set(0)
  levels = (p - 1).bit_length()
  for j in range(levels):
    s = 2**j
    merging = (rank % (2 * s) == 0) & (rank + s < p)
    # The receiver has the lower rank: its own pairs come first in the sum.
    kept_off, kept_val, union, dropped = merge_with_partner(
        offsets, values, k, perm=reduce_pairs(p, j), axis_name=axis_name)
    residual = residual.at[jnp.where(merging & dropped, union.offsets, INVALID)].add(
        union.sums, mode="drop")
    offsets = jnp.where(merging, kept_off, offsets)
    values = jnp.where(merging, kept_val, values)
  for j in reversed(range(levels)):
    s = 2**j
    down = [(receiver, sender) for sender, receiver in reduce_pairs(p, j)]
    message = jax.lax.ppermute(messages.pack(offsets[None], values[None]), axis_name,
                               perm=down)
    theirs_off, theirs_val = messages.unpack(message, k, x.dtype)
    receiving = rank % (2 * s) == s
    offsets = jnp.where(receiving, theirs_off[0], offsets)
    values = jnp.where(receiving, theirs_val[0], values)
  y = jnp.zeros((n,), x.dtype).at[offsets].set(values / p, mode="drop")
  return y, ResidualState(residual)


def paper(p: int, n: int, k: int) -> protocol.PaperCost:
  """The paper's Table 1: ``2 log P`` rounds, ``4 k log P`` elements."""
  del n
  lg = math.log2(p) if p > 1 else 0.0
  return protocol.PaperCost(2 * lg, (4 * lg * k,) * 2)


@protocol.register
@dataclasses.dataclass(frozen=True)
class GTopk(Baseline):
  """tree merge of top-k + broadcast as a registered all-reduce (options: :class:`GTopkConfig`)."""

  name: ClassVar[str] = "gtopk"
  summary: ClassVar[str] = "tree merge of top-k + broadcast"
  Config: ClassVar[type] = GTopkConfig
  config: GTopkConfig
  allreduce = staticmethod(gtopk_allreduce)
  cost = staticmethod(formula)
  paper = staticmethod(paper)
