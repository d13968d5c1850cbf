"""TopkDSA: SparCML's dynamic sparse all-reduce (a baseline of the paper).

Split and reduce, then gather. The vector is cut into ``P`` equal regions and region ``j``
is reduced on worker ``j``: each worker sends, in ``P - 1`` direct rounds, the entries of
its local top-``k`` that fall in each other worker's region; the owner sums what it gets.
Then every region is all-gathered (Bruck) — as sparse pairs, or dense when the pairs would
be larger than the region ("switching to dense when the reduced support grows large").

Static shapes: each split message holds at most ``c = ceil(capacity * k / P)`` pairs (and
never more than the region). A worker whose top-``k`` puts more than ``c`` entries in one
region sends that region's ``c`` largest and keeps the rest in its residual: nothing is lost,
it is sent later. The sparse-or-dense choice of the gather is made when tracing, from the
capacity (``P c`` pairs against a dense region), since every worker must send the same shape.
The residual keeps exactly what was not sent (the published code's strict ``>`` threshold
loses the k-th entry; this selection is exact).

References:
  Renggli et al., "SparCML: High-Performance Sparse Communication for Machine Learning",
  SC 2019.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar
import math

import jax
import jax.numpy as jnp

from spardl_jax._src.baselines.common import (Baseline, ResidualState, allgather, check_local, densify,
                                         exchange, local_topk, topk_count)
from spardl_jax._src.core import messages, protocol, topk
from spardl_jax._src.core.config import DensityConfig, check_positive
from spardl_jax._src.core.sparse import INVALID, sparse_sum

__all__ = ['TopkDSAConfig', 'sizes', 'formula', 'split_by_region', 'topkdsa_allreduce', 'paper',
           'TopkDSA']


@dataclasses.dataclass(frozen=True, kw_only=True)
class TopkDSAConfig(DensityConfig):
  """Attributes:
    density: fraction ``k / n`` each worker selects, in (0, 1].
    capacity: split-message capacity as a multiple of the balanced share ``k / P`` (> 0).
  """

  capacity: float = 2.0

  def __post_init__(self):
    super().__post_init__()
    check_positive(self, "capacity")



def sizes(p: int, n: int, config: TopkDSAConfig) -> tuple[int, int, int, bool]:
  """``(k, region, c, dense)``: top-k size, region length, split capacity, dense gather."""
  k = topk_count(config.density, n)
  region = -(-n // p)
  c = max(1, min(region, k, math.ceil(config.capacity * k / p)))
  return k, region, c, 2 * p * c >= region


def formula(p: int, n: int, config: TopkDSAConfig, itemsize: int = 4) -> protocol.Cost:
  """``rounds`` = (P - 1) + ceil(log2 P); ``bytes`` each worker sends."""
  k, region, c, dense = sizes(p, n, config)
  gather = region * itemsize if dense else p * c * (4 + itemsize)
  return protocol.Cost((p - 1) + (p - 1).bit_length(),
                       (p - 1) * (c * (4 + itemsize) + gather))


def split_by_region(offsets, values, region: int, p: int, c: int):
  """``(P, c)`` tables: row ``j`` holds the (up to) ``c`` largest entries in region ``j``.

  The offsets ascend, so each region's entries are one run of them. A region with at most
  ``c`` entries sends its run as it is; only when some region holds more does every region
  pick its top ``c`` by ``|value|`` (ties to the lower offset), in a window over its run.
  That selection is local, so a per-worker branch is safe. Ordering all ``k`` entries by
  magnitude instead would cost a multi-operand sort every call (benchmarks/results/sync_methods.md).

  Args:
    offsets, values: ``(k,)`` the local top-``k``, offsets ascending.

  Returns:
    ``(table_offsets, table_values, sent)``: rows ascending, empty slots :data:`INVALID`
    and 0; ``sent`` ``(k,)`` marks the entries placed.
  """
  k = offsets.shape[0]
  starts = jnp.searchsorted(offsets, jnp.arange(p + 1, dtype=jnp.int32) * region)
  count = starts[1:] - starts[:-1]
  crowded = count > c
  slots = jnp.arange(c, dtype=jnp.int32)

  def top_of_each_region():
    window = jnp.arange(min(k, region), dtype=jnp.int32)
    at = jnp.minimum(starts[:-1, None] + window, k - 1)
    # Past a region's run the window holds key 0 at higher positions: never a winner.
    run_keys = jnp.where(window < count[:, None], topk.keys(values)[at], 0)
    return jnp.where(crowded[:, None], topk.select(run_keys, c), slots)

  # `+ zeros_like(...)` gives the plain branch the windows' shard_map type (varying).
  within = jax.lax.cond(jnp.any(crowded), top_of_each_region,
                        lambda: slots + jnp.zeros_like(starts[:-1, None]))
  at = starts[:-1, None] + within
  filled = slots < count[:, None]
  safe = jnp.minimum(at, k - 1)
  table_off = jnp.where(filled, offsets[safe], INVALID)
  table_val = jnp.where(filled, values[safe], jnp.zeros((), values.dtype))
  sent = jnp.zeros((k,), jnp.bool_).at[jnp.where(filled, at, k)].set(True, mode="drop")
  return table_off, table_val, sent


def topkdsa_allreduce(x: jax.Array, state: ResidualState, config: TopkDSAConfig, *,
                      axis_name) -> tuple[jax.Array, ResidualState]:
  """Mean over ``axis_name`` of every worker's local top-k, by split-reduce-gather.

  Returns:
    ``(y, state)``: ``y`` ``(n,)`` bit-identical on every worker; the residual is ``g``
    without the entries this worker sent.
  """
  check_local("topkdsa_allreduce", x, state.residual)
  p = jax.lax.axis_size(axis_name)
  n = x.shape[0]
  k, region, c, dense = sizes(p, n, config)
  rank = jax.lax.axis_index(axis_name)
  g = x + state.residual
  offsets, values = local_topk(g, k)
  table_off, table_val, sent = split_by_region(offsets, values, region, p, c)
  residual = g.at[jnp.where(sent, offsets, INVALID)].set(0, mode="drop")
  rows_off, rows_val = exchange(table_off, table_val, p=p, rank=rank, axis_name=axis_name)
  union = sparse_sum(rows_off, rows_val)
  # Regions are disjoint, so each entry of y is one of these sums: dividing them here gives
  # the same bits as dividing y, without a pass over n.
  mean = union.sums / p
  if dense:
    local = jnp.where(union.offsets == INVALID, INVALID, union.offsets - rank * region)
    block = jnp.zeros((region,), x.dtype).at[local].set(mean, mode="drop")
    y = allgather(block[None], axis_name).reshape(-1)[:n]
  else:
    rows = allgather(messages.pack(union.offsets[None], mean[None]), axis_name)
    all_off, all_val = messages.unpack(rows, p * c, x.dtype)
    y = densify(n, all_off, all_val, x.dtype)
  return y, ResidualState(residual)


def paper(p: int, n: int, k: int) -> protocol.PaperCost:
  """The paper's Table 1: ``P + 2 log P`` rounds, ``4 (P - 1) / P k`` to ``(P - 1) / P (2 k +
  n)`` elements (sparse to dense)."""
  f = (p - 1) / p
  return protocol.PaperCost(p + 2 * (math.log2(p) if p > 1 else 0.0),
                            (4 * f * k, f * (2 * k + n)))


@protocol.register
@dataclasses.dataclass(frozen=True)
class TopkDSA(Baseline):
  """SparCML split-reduce-gather, dense switch as a registered all-reduce (options: :class:`TopkDSAConfig`)."""

  name: ClassVar[str] = "topkdsa"
  summary: ClassVar[str] = "SparCML split-reduce-gather, dense switch"
  Config: ClassVar[type] = TopkDSAConfig
  config: TopkDSAConfig
  allreduce = staticmethod(topkdsa_allreduce)
  cost = staticmethod(formula)
  paper = staticmethod(paper)
