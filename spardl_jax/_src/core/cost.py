"""The alpha-beta model of one sparse all-reduce, and the choice of SparDL's team count.

Modeled time = ``rounds * alpha + bytes * beta`` with the per-worker rounds and bytes of
:func:`spardl_formula` (the ones the tests measure from compiled HLO).
For B-SAG the model assumes the largest message, ``h = kb`` (fully disjoint indices), so it
never favours B-SAG on an optimistic guess; pass ``alpha`` and ``beta`` measured on your
cluster to the config.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from spardl_jax._src.core import messages
from spardl_jax._src.core.config import ETHERNET_10G, INFINIBAND_100G, Blocks
from spardl_jax._src.core.protocol import PaperCost

__all__ = ["ETHERNET_10G", "INFINIBAND_100G", "SparDLCost", "team_counts", "choose_teams",
           "modeled_seconds", "sag_kind", "spardl_cost", "spardl_formula", "spardl_paper_cost",
           "wire_format"]


def sag_kind(teams: int, sag: str) -> str:
  """``'recursive'`` or ``'bruck'``: what ``sag`` means for ``teams`` (``d``)."""
  if sag == "auto":
    return "recursive" if teams & (teams - 1) == 0 else "bruck"
  return sag


class SparDLCost(NamedTuple):
  """SparDL's :class:`~spardl_jax._src.core.protocol.Cost` with its details: ``elements`` (an
  offset and a value per pair, whatever the format, plus B-SAG's count words), and the
  ``teams``, ``sag`` and ``kb`` it was computed for (when :func:`spardl_cost` knows them)."""

  rounds: Any
  bytes: Any
  bytes_per_device: None = None
  elements: Any = None
  teams: int | None = None
  sag: str | None = None
  kb: int | None = None


def spardl_formula(p: int, kb: int, value_bytes: int = 4, *, teams: int = 1,
                   sag: str = "recursive", h=None,
                   wire: messages.Wire = messages.EXACT) -> SparDLCost:
  """The ``docs/design.md`` cost of one SparDL all-reduce, per worker.

  With ``Q = P / d`` and, in the exact format, a pair = int32 offset + value:

  * ``d = 1``: ``2 ceil(log2 P)`` rounds, ``4 kb (P - 1)`` elements.
  * R-SAG: ``2 ceil(log2 Q) + log2 d`` rounds, ``4 kb (Q - 1) + 2 kb log2 d`` elements.
  * B-SAG: ``2 ceil(log2 Q) + ceil(log2 d)`` rounds, ``4 kb (Q - 1) + 2 h (d - 1)``
    elements, plus one int32 word (the distinct count that makes ``h`` global) in each of
    the ``Q - 1`` blocks of the final Bruck all-gather.

  Bytes are the blocks' sizes under ``wire`` (:meth:`~spardl_jax._src.core.messages.Wire.
  block_bytes`); ``elements`` counts an offset and a value per pair whatever the format.

  Args:
    p: workers; kb: pairs per block; value_bytes: the value dtype's size.
    teams: ``d``; sag: ``'recursive'`` or ``'bruck'`` (used when ``d > 1``).
    h: the B-SAG message size (an int or a traced scalar).
    wire: the message format.

  Returns:
    a :class:`SparDLCost` (``elements`` and ``bytes`` follow ``h``'s type).
  """
  q = p // teams
  lq = (q - 1).bit_length()
  rounds, blocks, pairs, words = 2 * lq, 2 * (q - 1), 2 * kb * (q - 1), 0
  other = 0  # bytes of B-SAG's blocks of h pairs
  if teams > 1 and sag == "recursive":
    rounds += (teams - 1).bit_length()
    blocks += (teams - 1).bit_length()
    pairs += kb * (teams - 1).bit_length()
  elif teams > 1:
    if h is None:
      raise ValueError("spardl_formula: B-SAG needs the message size h.")
    rounds += (teams - 1).bit_length()
    pairs = pairs + h * (teams - 1)
    other = wire.block_bytes(h, value_bytes) * (teams - 1)
    words = q - 1
  size = blocks * wire.block_bytes(kb, value_bytes) + other + 4 * words
  return SparDLCost(rounds, size, elements=2 * pairs + words)


def spardl_cost(p: int, n: int, density: float, teams: int, *, itemsize: int = 4,
                sag: str = "auto", h=None, wire: str = "exact") -> SparDLCost:
  """Per-worker :class:`SparDLCost` of one all-reduce of ``n`` (with ``teams``, ``sag`` and
  ``kb`` filled in).

  ``h`` is B-SAG's message size (an int or a traced scalar); by default the largest, ``kb``.
  ``wire`` is ``SparDLConfig.wire``.
  """
  layout = Blocks.make(n, p // teams, density)
  kind = sag_kind(teams, sag)
  cost = spardl_formula(p, layout.kb, itemsize, teams=teams, sag=kind,
                        h=layout.kb if h is None else h, wire=wire_format(wire, layout))
  return cost._replace(teams=teams, sag=kind if teams > 1 else "-", kb=layout.kb)


def wire_format(wire: str, layout: Blocks) -> messages.Wire:
  """The :class:`~spardl_jax._src.core.messages.Wire` of ``SparDLConfig.wire`` for ``layout``."""
  return messages.Wire(compact=wire != "exact", span=layout.m, kb=layout.kb,
                       bits=messages.VALUE_BITS.get(wire, 0))


def modeled_seconds(cost, *, alpha: float, beta: float) -> float:
  """``rounds * alpha + bytes * beta`` of a :class:`~spardl_jax._src.core.protocol.Cost`."""
  return cost.rounds * alpha + cost.bytes * beta


def team_counts(p: int, sag: str = "auto") -> list[int]:
  """The team counts ``d`` that fit ``p`` workers: the divisors of ``p`` (powers of two only,
  for R-SAG: ``sag='recursive'``), ascending."""
  return [d for d in range(1, p + 1) if p % d == 0 and not (sag == "recursive" and d & (d - 1))]


def choose_teams(p: int, n: int, density: float, *, alpha: float, beta: float,
                 itemsize: int = 4, sag: str = "auto", wire: str = "exact") -> int:
  """The team count ``d`` of :func:`team_counts` with the least modeled time (the smaller
  ``d`` on a tie)."""
  return min(team_counts(p, sag), key=lambda d: (modeled_seconds(
      spardl_cost(p, n, density, d, itemsize=itemsize, sag=sag, wire=wire), alpha=alpha,
      beta=beta), d))


def spardl_paper_cost(p: int, k: int, d: int = 1, *, sag: str = "auto") -> PaperCost:
  """SparDL's rows of the paper's Table 1 for ``d`` teams, with ``log = log2`` and ``k`` the
  total number of selected entries."""
  lg = math.log2(p) if p > 1 else 0.0
  if d == 1:
    return PaperCost(2 * lg, (4 * (p - 1) / p * k,) * 2)
  lq, ld = math.log2(p / d), math.log2(d)
  if sag_kind(d, sag) == "recursive":
    return PaperCost(2 * lq + ld, (2 * ((2 * p - 2 * d) / p + d / p * ld) * k,) * 2)
  return PaperCost(2 * lq + ld, (2 * (d * d + p - 2 * d) / (p * d) * k,
                                 2 * (d * d + 2 * p - 3 * d) / p * k))