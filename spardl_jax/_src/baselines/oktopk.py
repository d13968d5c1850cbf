"""Ok-Topk: threshold-based sparse all-reduce with balanced regions (a baseline of the paper).

Per step, on every worker:

1. **Local selection by threshold**: send the entries of ``g = x + residual`` whose ``|g|`` is
   at least a local threshold, re-estimated exactly (the k-th largest ``|g|``) every ``tau``
   steps and reused in between (selection without a top-k most of the time).
2. **Split and reduce over balanced regions**: the vector is cut into ``P`` regions whose
   boundaries are re-balanced every ``tau_regions`` steps, from where the last global result
   fell, so every worker reduces about ``k / P`` entries. Each worker sends the selected
   entries of region ``j`` to worker ``j`` (``P - 1`` direct rounds); owners sum them.
3. **Global selection by threshold**: each owner keeps the reduced entries at or above a
   global threshold and all-gathers them (Bruck). Every ``tau`` steps the threshold is
   re-estimated: owners send their largest reduced entries, and every worker takes the k-th
   largest of everything gathered (the same value everywhere, no extra round).

Static shapes: a split message holds at most ``c = ceil(capacity * k / P)`` pairs and a
gathered block at most ``c`` pairs too. What does not fit (overflow), what is below a
threshold, and what the global selection rejects goes back to the residual of the worker
that holds it, so no gradient mass is lost; a tight capacity only delays entries.
Simplifications against the paper: regions are balanced by the last result's positions
(known to every worker after the all-gather) instead of a separate statistics exchange, and
the split uses a plain rotation of destinations.

References:
  Li and Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep Learning", PPoPP 2022.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

from spardl_jax._src.baselines.common import (Baseline, allgather, check_local, densify, exchange,
                                         topk_count)
from spardl_jax._src.core import messages, protocol, topk
from spardl_jax._src.core.config import DensityConfig, check_positive
from spardl_jax._src.core.sparse import INVALID, Union, sparse_sum, top_of_union

__all__ = ['OkTopkConfig', 'OkTopkState', 'init_state', 'capacity', 'formula', 'oktopk_allreduce',
           'paper', 'OkTopk']


@dataclasses.dataclass(frozen=True, kw_only=True)
class OkTopkConfig(DensityConfig):
  """Attributes:
    density: target fraction ``k / n`` of the global result, in (0, 1].
    capacity: message capacity as a multiple of the balanced share ``k / P`` (> 0).
    tau: steps between exact re-estimations of the thresholds (>= 1).
    tau_regions: steps between re-balancings of the region boundaries (>= 1).
  """

  capacity: float = 2.0
  tau: int = 32
  tau_regions: int = 32

  def __post_init__(self):
    super().__post_init__()
    check_positive(self, "capacity")
    check_positive(self, "tau", numbers.Integral)
    check_positive(self, "tau_regions", numbers.Integral)


@protocol.folds(residual=protocol.SUM)
class OkTopkState(NamedTuple):
  """Per-device state.

  Attributes:
    residual: ``(n,)`` discarded gradient mass, the gradient's dtype.
    local_threshold: () int32 key (float32 bits of ``|g|``) of the local selection.
    global_threshold: () int32 key of the global selection (the same on every worker).
    boundaries: ``(P + 1,)`` int32 region boundaries (the same on every worker).
    step: () int32 steps taken.
  """

  residual: jax.Array
  local_threshold: jax.Array
  global_threshold: jax.Array
  boundaries: jax.Array
  step: jax.Array


def init_state(n: int, p: int, config: OkTopkConfig, dtype=jnp.float32) -> OkTopkState:
  """Zero residual, thresholds to be estimated at step 0, ``P`` equal regions."""
  del config
  region = -(-n // p)
  bounds = jnp.minimum(jnp.arange(p + 1, dtype=jnp.int32) * region, n)
  zero = jnp.zeros((), jnp.int32)
  return OkTopkState(jnp.zeros((n,), dtype), zero, zero, bounds, zero)


def capacity(p: int, n: int, config: OkTopkConfig) -> tuple[int, int]:
  """``(k, c)``: the target count and the per-message capacity."""
  k = topk_count(config.density, n)
  return k, max(1, min(n, math.ceil(config.capacity * k / p)))


def formula(p: int, n: int, config: OkTopkConfig, itemsize: int = 4) -> protocol.Cost:
  """``rounds`` = (P - 1) + ceil(log2 P); ``bytes`` = (P - 1) 2 c pairs (a bound: the
  messages are full-capacity static shapes)."""
  _, c = capacity(p, n, config)
  return protocol.Cost((p - 1) + (p - 1).bit_length(), (p - 1) * 2 * c * (4 + itemsize))


_BLOCK = 32  # entries per block of the two-level prefix count (fastest on XLA:CPU)


def _split_table(g, selected, boundaries, p: int, c: int):
  """``(P, c)`` tables of the selected entries of each region (in index order, the first
  ``c`` of a region): offsets (INVALID in empty slots) and values.

  The published algorithm's cost is one pass over ``n`` plus work in ``k``; so is this one's.
  Over ``n``: one count of the selected entries per block of 32
  (:class:`~spardl_jax._src.core.topk.GroupCounts`, shared with the selection's compaction). Slot
  ``s`` of region ``j`` holds the selected entry with (selected before the region + ``s``)
  selected entries before it, found by a binary search among the block counts and a count
  inside its block. No prefix sum, boundary search or scatter runs over ``n`` (they made it
  several times slower at the paper's sizes: benchmarks/results/sync_methods.md).
  """
  counts = topk.GroupCounts.of(selected, _BLOCK)
  start = counts.before(boundaries)  # (P + 1,) selected entries before each boundary
  target = start[:-1, None] + jnp.arange(c, dtype=jnp.int32)[None]  # ranks, 0-based
  valid = target < start[1:, None]
  index = counts.nth(target.reshape(-1)).reshape(p, c)
  offsets = jnp.where(valid, index, INVALID)
  values = jnp.where(valid, g[jnp.where(valid, index, 0)], 0)
  return offsets, values


def _rebalanced(result_offsets, n: int, p: int, old):
  """Boundaries putting the same number of ``result_offsets`` in each region."""
  ordered = jnp.sort(result_offsets)
  count = jnp.sum(ordered != INVALID)
  cuts = ordered[(jnp.arange(1, p) * count) // p]
  new = jnp.concatenate([jnp.zeros((1,), jnp.int32), cuts, jnp.full((1,), n, jnp.int32)])
  return jnp.where(count >= p, new, old)


class _Step(NamedTuple):
  """What one call fixes: the devices ``p``, the target ``k``, the capacity ``c``, this
  worker's ``rank``, and whether the thresholds are re-estimated (``estimate``)."""

  p: int
  k: int
  c: int
  rank: jax.Array
  estimate: jax.Array


class _Reduced(NamedTuple):
  """Step 2's result: the residual with the sent entries taken out, and this owner's sums."""

  residual: jax.Array
  union: Union


class _Gathered(NamedTuple):
  """Step 3's result: what this owner sent (``offsets``, ``values``, the union slots it
  ``sent``), every owner's ``(P, c)`` gathered values ``all_val`` and the offsets of those the
  result holds (``result``, INVALID for the rest), and the global ``threshold``."""

  offsets: jax.Array
  values: jax.Array
  sent: jax.Array
  all_val: jax.Array
  result: jax.Array
  threshold: jax.Array


def local_selection(x, state: OkTopkState, step: _Step
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Step 1: ``(g, selected, local threshold)``: ``g = x + residual``, its entries at or
  above the threshold, and the threshold's key (re-estimated, the k-th largest ``|g|``, on
  estimation steps only: a cond, the same decision on every worker)."""
  g = x + state.residual
  # The keys are formed inside the branch and again for the comparison: passed to the cond,
  # they would be written out whole (n int32) on every step, not fused into the comparison.
  threshold = jax.lax.cond(step.estimate,
                           lambda: topk.kth_largest(topk.keys(g)[None], step.k)[0],
                           lambda: state.local_threshold)
  return g, topk.keys(g) >= threshold, threshold


def split_and_reduce(g, selected, boundaries, step: _Step, axis_name) -> _Reduced:
  """Step 2: the ``selected`` entries of each region to its owner (``P - 1`` direct rounds),
  and the owner's sum of what it received."""
  table_off, table_val = _split_table(g, selected, boundaries, step.p, step.c)
  # What is sent leaves the residual: zeros written over g at the sent offsets, in place
  # (a mask of n and a pass over n cost more on XLA:CPU).
  residual = g.at[table_off.reshape(-1)].set(0, mode="drop")
  return _Reduced(residual, sparse_sum(*exchange(table_off, table_val, p=step.p,
                                                 rank=step.rank, axis_name=axis_name)))


def global_selection(union: Union, state: OkTopkState, step: _Step, axis_name) -> _Gathered:
  """Step 3: each owner's sums at or above the global threshold (at most ``c``, the
  largest), all-gathered (Bruck); the threshold re-estimated on its steps from everything
  gathered (the same value everywhere, no extra round)."""
  valid = union.offsets != INVALID
  candidate = valid & (step.estimate | (topk.keys(union.sums) >= state.global_threshold))
  send_off, send_val, sent = top_of_union(
      Union(jnp.where(candidate, union.offsets, INVALID), union.sums, union.count), step.c)
  rows = allgather(messages.pack(send_off[None], send_val[None]), axis_name)
  all_off, all_val = messages.unpack(rows, step.c, union.sums.dtype)
  all_keys = jnp.where(all_off != INVALID, topk.keys(all_val), 0)
  threshold = jax.lax.cond(
      step.estimate,
      lambda: topk.kth_largest(all_keys.reshape(1, -1), min(step.k, step.p * step.c))[0],
      lambda: state.global_threshold)
  accepted = (all_off != INVALID) & (all_keys >= threshold)
  return _Gathered(send_off, send_val, sent, all_val, jnp.where(accepted, all_off, INVALID),
                   threshold)


def result_and_residual(reduced: _Reduced, gathered: _Gathered, step: _Step
                        ) -> tuple[jax.Array, jax.Array]:
  """Step 4: ``(y, residual)``: the mean of the accepted pairs, and the residual with what
  this owner reduced or sent but the result does not hold taken back."""
  n = reduced.residual.shape[0]
  # Owners' regions are disjoint: each entry is one value, divided before it is placed (the
  # same bits as dividing the dense result, without a pass over n).
  y = densify(n, gathered.result, gathered.all_val / step.p, reduced.residual.dtype)
  union = reduced.union
  residual = reduced.residual.at[
      jnp.where((union.offsets != INVALID) & ~gathered.sent, union.offsets, INVALID)].add(
          union.sums, mode="drop")
  mine = gathered.result[step.rank] != INVALID
  residual = residual.at[jnp.where((gathered.offsets != INVALID) & ~mine, gathered.offsets,
                                   INVALID)].add(gathered.values, mode="drop")
  return y, residual


def oktopk_allreduce(x: jax.Array, state: OkTopkState, config: OkTopkConfig, *,
                     axis_name) -> tuple[jax.Array, OkTopkState]:
  """Mean over ``axis_name`` of the threshold-selected global sparse sum; inside shard_map.

  Returns:
    ``(y, state)``: ``y`` ``(n,)`` bit-identical on every worker, and the new state.
  """
  check_local("oktopk_allreduce", x, state.residual)
  p = jax.lax.axis_size(axis_name)
  n = x.shape[0]
  step = _Step(p, *capacity(p, n, config), jax.lax.axis_index(axis_name),
               state.step % config.tau == 0)
  g, selected, local_threshold = local_selection(x, state, step)
  reduced = split_and_reduce(g, selected, state.boundaries, step, axis_name)
  gathered = global_selection(reduced.union, state, step, axis_name)
  y, residual = result_and_residual(reduced, gathered, step)
  # Re-balancing runs only on its steps (a cond: no sort on the other steps).
  rebalance = (state.step + 1) % config.tau_regions == 0
  boundaries = jax.lax.cond(rebalance,
                            lambda: _rebalanced(gathered.result.reshape(-1), n, p,
                                                state.boundaries),
                            lambda: state.boundaries)
  return y, OkTopkState(residual, local_threshold, gathered.threshold, boundaries,
                        state.step + 1)


def paper(p: int, n: int, k: int) -> protocol.PaperCost:
  """The paper's Table 1: ``2 (P + log P)`` rounds, ``2 (P - 1) / P k`` to ``6 (P - 1) / P k``
  elements."""
  del n
  f = (p - 1) / p
  return protocol.PaperCost(2 * (p + (math.log2(p) if p > 1 else 0.0)), (2 * f * k, 6 * f * k))


@protocol.register
@dataclasses.dataclass(frozen=True)
class OkTopk(Baseline):
  """Ok-Topk: thresholds, balanced regions as a registered all-reduce (options: :class:`OkTopkConfig`)."""

  name: ClassVar[str] = "oktopk"
  summary: ClassVar[str] = "Ok-Topk: thresholds, balanced regions"
  Config: ClassVar[type] = OkTopkConfig
  config: OkTopkConfig
  allreduce = staticmethod(oktopk_allreduce)
  cost = staticmethod(formula)
  paper = staticmethod(paper)
  initial = staticmethod(init_state)
  # A region with more than c selected entries sends the first c in index order, so a NaN
  # there may stay behind in the residual: the devices agree through one scalar pmax.
  nonfinite_reaches_result: ClassVar[bool] = False
