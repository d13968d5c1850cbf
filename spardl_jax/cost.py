"""The alpha-beta model of one sparse all-reduce, and the choice of SparDL's team count.

Modeled time = ``rounds * alpha + bytes * beta`` with the per-worker rounds and bytes of
:func:`spardl_jax.traffic.spardl_formula` (the ones the tests measure from compiled HLO).
For B-SAG the model assumes the largest message, ``h = kb`` (fully disjoint indices), so it
never favours B-SAG on an optimistic guess; pass ``alpha`` and ``beta`` measured on your
cluster to the config.
"""

from __future__ import annotations

from spardl_jax import traffic
from spardl_jax.config import BlockLayout

ETHERNET_10G = {"alpha": 50e-6, "beta": 1 / 1.25e9}
INFINIBAND_100G = {"alpha": 2e-6, "beta": 1 / 12.5e9}


def sag_kind(teams: int, sag: str) -> str:
  """``'recursive'`` or ``'bruck'``: what ``sag`` means for ``teams`` (``d``)."""
  if sag == "auto":
    return "recursive" if teams & (teams - 1) == 0 else "bruck"
  return sag


def spardl_cost(p: int, n: int, density: float, teams: int, *, itemsize: int = 4,
                sag: str = "auto") -> dict:
  """Per-worker ``rounds``, ``bytes`` (and ``kb``, ``sag``) of one all-reduce of ``n``."""
  kb = BlockLayout.make(n, p // teams, density).kb
  kind = sag_kind(teams, sag)
  cost = traffic.spardl_formula(p, kb, itemsize, teams=teams, sag=kind, h=kb)
  return {"teams": teams, "sag": kind if teams > 1 else "-", "kb": kb, **cost}


def modeled_seconds(cost: dict, *, alpha: float, beta: float) -> float:
  """``rounds * alpha + bytes * beta``."""
  return cost["rounds"] * alpha + cost["bytes"] * beta


def choose_teams(p: int, n: int, density: float, *, alpha: float, beta: float,
                 itemsize: int = 4, sag: str = "auto") -> int:
  """The divisor ``d`` of ``p`` with the least modeled time (the smaller ``d`` on a tie)."""
  divisors = [d for d in range(1, p + 1) if p % d == 0
              and not (sag == "recursive" and d & (d - 1))]
  return min(divisors, key=lambda d: (modeled_seconds(
      spardl_cost(p, n, density, d, itemsize=itemsize, sag=sag), alpha=alpha, beta=beta), d))
