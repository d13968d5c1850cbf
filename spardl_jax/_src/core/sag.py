"""Spar-All-Gather (SAG): combining the d teams' reduced blocks, between SRS and the final
Bruck all-gather inside each team.

After SRS, the worker at position ``r`` of every team holds its team's sum of block ``r``.
SAG makes those ``d`` workers agree on one sparse sum of block ``r``:

* **R-SAG** (``d`` a power of two): ``log2 d`` recursive-doubling exchanges of ``kb`` pairs
  with the same position in team ``t XOR 2^j``; both sides add, keep the top-``kb`` of the
  sum and share the discard as residual.
* **B-SAG** (any ``d``): a Bruck all-gather of each worker's top-``h`` pairs across the
  teams, a sum, and the top-``kb`` of it. ``h`` is adapted by :mod:`spardl_jax._src.core.h_controller`;
  each static size ``h`` of :func:`spardl_jax._src.core.schedule.h_ladder` is one ``lax.switch``
  branch, so ``h`` changes without recompiling and the bytes sent follow it.

Sums are taken over rows in team order, so every worker computes bit-identical results.
Empty slots carry the offset :data:`~spardl_jax._src.core.sparse.INVALID` and the value 0.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spardl_jax._src.core import bruck, h_controller, ints, messages, schedule
from spardl_jax._src.core.sparse import (INVALID, in_worker_order, magnitude_order,
                               merge_with_partner, sparse_sum, top_of_union)

__all__ = ['Share', 'as_sent', 'recursive_sag', 'bruck_sag', 'SagResult',
           'spar_all_gather', 'next_controller']


class Share(NamedTuple):
  """Discarded R-SAG mass this worker keeps: ``values`` at block ``offsets`` (``(L,)``)."""

  offsets: jax.Array
  values: jax.Array


def as_sent(offsets: jax.Array, values: jax.Array, holder: jax.Array, wire: messages.Wire
            ) -> tuple[jax.Array, list[Share]]:
  """``(kb,)`` values held in identical copies by a group of workers, as ``wire`` carries
  them, and the rounding error as the :class:`Share` of the group's ``holder`` (() bool,
  True on one worker of the group): the error stays once, exactly, with one sender."""
  rounded = wire.round(values)
  if rounded is values:
    return values, []
  return rounded, [Share(offsets, jnp.where(holder, values - rounded, 0))]


def recursive_sag(offsets: jax.Array, values: jax.Array, *, kb: int, p: int, q: int,
                  team: jax.Array, axis_name, wire: messages.Wire = messages.EXACT
                  ) -> tuple[jax.Array, jax.Array, list[Share]]:
  """R-SAG of this worker's ``(kb,)`` pairs of its own block with the other teams.

  At step ``j`` the merged group has ``2^(j+1)`` workers holding identical copies, so each
  keeps ``1 / 2^(j+1)`` of the discard (the paper's "half" at ``j = 0``; "half" at every step
  would count a discard ``2^j`` times once groups hold copies). Before step ``j`` the values
  are rounded as the wire carries them; the group's lowest team keeps the error.

  Returns:
    ``(offsets, values, shares)``: the ``(kb,)`` agreed pairs (not yet rounded) and the
    :class:`Share` of every step.
  """
  d = p // q
  shares = []
  for j in range(d.bit_length() - 1):
    values, error = as_sent(offsets, values, ints.rem(team, 2**j) == 0, wire)
    shares += error
    # The lower team's pairs come first in the sum, on both sides of the exchange.
    offsets, values, union, dropped = merge_with_partner(
        offsets, values, kb, perm=schedule.recursive_doubling_permutation(p, q, j),
        axis_name=axis_name, mine_first=ints.rem(team >> j, 2) == 0, wire=wire)
    shares.append(Share(jnp.where(dropped, union.offsets, INVALID),
                        union.sums * np.asarray(0.5 ** (j + 1), values.dtype)))
  return offsets, values, shares


def bruck_sag(offsets: jax.Array, values: jax.Array, level: jax.Array, *,
              ladder: tuple[int, ...], kb: int, p: int, q: int, team: jax.Array,
              axis_name, wire: messages.Wire = messages.EXACT
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """B-SAG of this worker's candidates with the other teams, sending ``ladder[level]`` pairs.

  The paper also gives each worker ``1/d`` of the discard; a discarded index is never in the
  final result, so global residual collection restores the gradient there anyway and the
  share would be overwritten: it is not computed.

  Args:
    offsets, values: ``(kb,)`` candidates by decreasing ``|value|``, ties to the lower offset
      (:func:`~spardl_jax._src.core.sparse.magnitude_order`), so the top-``h`` is a prefix.
    level: () int32 index into ``ladder``, the same on every worker.
    ladder: the static message sizes.
    wire: the message format; ``values`` must already be as it carries them.

  Returns:
    ``(offsets, values, count)``: the ``(kb,)`` agreed pairs and the () int32 number of
    distinct indices gathered.
  """
  d = p // q

  def branch(h):
    def gather(offsets, values):
      offsets, values = offsets[:h], values[:h]
      if wire.compact:  # compact blocks need ascending offsets; the sum ignores the order
        offsets, values = jax.lax.sort((offsets, values), num_keys=1)
      message = wire.pack(offsets[None], values[None])
      rows = bruck.bruck_allgather(
          message, size=d, axis_name=axis_name,
          permutation=lambda shift: schedule.cross_team_permutation(p, q, shift))
      rows_off, rows_val = wire.unpack(in_worker_order(rows, team), h, values.dtype)
      union = sparse_sum(rows_off, rows_val)
      kept_off, kept_val, _ = top_of_union(union, kb)
      return kept_off, kept_val, union.count
    return gather

  return jax.lax.switch(level, [branch(h) for h in ladder], offsets, values)


class SagResult(NamedTuple):
  """What Spar-All-Gather leaves on a worker (the stage between SRS and the final gather).

  Attributes:
    offsets, values: ``(kb,)`` the agreed sparse sum of this worker's block (ascending
      offsets, empty slots :data:`INVALID`), values as the wire carries them; without SAG,
      the worker's own selection.
    sent: ``(kb,)`` offsets of its own selection that left the worker, in its order,
      :data:`INVALID` for the rest (in-procedure residual): all of them except for B-SAG,
      which sends the top-``h``.
    shares: the R-SAG discards and the rounding errors this worker keeps, one
      :class:`Share` each.
    count: () int32 distinct indices B-SAG gathered (None otherwise), for the controller.
    controller: the :class:`~spardl_jax._src.core.h_controller.HState` after choosing this
      sync's ``h`` (``last_h`` is ``kb`` without B-SAG).
  """

  offsets: jax.Array
  values: jax.Array
  sent: jax.Array
  shares: list[Share]
  count: jax.Array | None  # type: ignore[assignment]  # a field named count shadows tuple.count
  controller: h_controller.HState


def spar_all_gather(offsets: jax.Array, values: jax.Array, controller: h_controller.HState, *,
                    kind: str, kb: int, p: int, q: int, team: jax.Array,
                    axis_name, wire: messages.Wire = messages.EXACT) -> SagResult:
  """Runs the Spar-All-Gather ``kind`` (``'none'``, ``'recursive'`` or ``'bruck'``) on this
  worker's ``(kb,)`` own-block selection (ascending offsets, values as ``wire`` carries
  them).

  All ``d`` teams' workers of a position end with the same agreed sum; it is rounded as the
  wire carries it once more for the final gather, and team 0's worker keeps the error.

  For B-SAG the controller picks ``h`` from the static ladder
  (:func:`~spardl_jax._src.core.schedule.h_ladder`): the smallest ladder size at least
  ``ceil(h)``, one ``lax.switch`` branch per size, so ``h`` moves without recompiling.
  """
  controller = controller._replace(last_h=jnp.int32(kb))
  if kind == "none":
    return SagResult(offsets, values, offsets, [], None, controller)
  if kind == "recursive":
    offsets_out, values_out, shares = recursive_sag(offsets, values, kb=kb, p=p, q=q, team=team,
                                                    axis_name=axis_name, wire=wire)
    values_out, error = as_sent(offsets_out, values_out, team == 0, wire)
    return SagResult(offsets_out, values_out, offsets, shares + error, None, controller)
  d = p // q
  ladder = schedule.h_ladder(kb, d)
  controller = h_controller.start(controller, kb=kb, d=d)
  sizes = jnp.asarray(ladder, jnp.int32)
  level = jnp.minimum(jnp.searchsorted(sizes, jnp.ceil(controller.h).astype(jnp.int32)),
                      len(ladder) - 1)
  h = sizes[level]
  order = magnitude_order(values)
  ordered_off, ordered_val = offsets[order], values[order]
  # In the selection's own (ascending) order, so that its rounding errors line up.
  place = jnp.zeros((kb,), jnp.int32).at[order].set(jnp.arange(kb, dtype=jnp.int32))
  sent = jnp.where(place < h, offsets, INVALID)
  offsets_out, values_out, count = bruck_sag(ordered_off, ordered_val, level, ladder=ladder,
                                             kb=kb, p=p, q=q, team=team, axis_name=axis_name,
                                             wire=wire)
  values_out, error = as_sent(offsets_out, values_out, team == 0, wire)
  return SagResult(offsets_out, values_out, sent, error, count, controller._replace(last_h=h))


def next_controller(result: SagResult, counts: jax.Array, *, kb: int, d: int
                    ) -> h_controller.HState:
  """The controller state for the next sync: Algorithm 2 driven by the mean of the ``(Q,)``
  B-SAG ``counts`` every worker learned from the final gather (unchanged without B-SAG)."""
  if result.count is None:
    return result.controller
  mean_count = jnp.sum(counts).astype(jnp.float32) / counts.shape[0]
  return h_controller.update(result.controller, mean_count, kb=kb, d=d)
