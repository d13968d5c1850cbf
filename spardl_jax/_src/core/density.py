"""SparDL's density picked from the number of devices: the rule behind ``density="auto"``.

SparDL's update keeps about k = density·n entries at every P, while each of its
``2·log2 P`` rounds of Spar-Reduce-Scatter keeps only the top entries of partial sums and
leaves the rest in the residuals: the more rounds, the more of each step's gradient waits.
At a fixed density its steps to accuracy therefore grow with P (docs/design.md, "The density
rule", has the measurements). The rule keeps them flat by growing the density with the
rounds: ``base`` at ``P = at``, times ``log2 P / log2 at``, at most ``most``.
"""

from __future__ import annotations

import dataclasses
import math

from spardl_jax._src.core.config import check_number

__all__ = ['AUTO', 'DensityRule', 'density_rule', 'as_rule', 'at_devices']

AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class DensityRule:
  """A density that depends on the devices ``p`` of the data axis, fixed when the sync is
  traced (see :func:`density_rule`)."""

  base: float
  at: int
  most: float

  def __post_init__(self):
    who = "density_rule"
    check_number(who, "base", self.base, "in (0, 1]", accept=lambda b: 0 < b <= 1)
    check_number(who, "at", self.at, "an int >= 2", integral=True, accept=lambda a: a >= 2)
    check_number(who, "most", self.most, f"in [base, 1] (base {self.base})",
                 accept=lambda m: self.base <= m <= 1)

  def __call__(self, p: int) -> float:
    """The density for ``p`` devices (``p >= 1``; one or two devices take the rule's
    value at two, a single round each way)."""
    rounds = math.log2(max(int(p), 2))
    return min(self.most, self.base * rounds / math.log2(self.at))


def density_rule(base: float = 0.025, *, at: int = 8, most: float = 0.1) -> DensityRule:
  """SparDL's density from the devices P, so that its steps to accuracy do not grow with P.

  ``density = min(most, base · log2 P / log2 at)``: ``base`` at ``P = at``, one ``base/log2
  at`` more for each doubling of P (each adds a round of Spar-Reduce-Scatter). The defaults
  are the measured rule (``density="auto"``): 2.5 % at P = 8, 3.3 % at 16, 4.2 % at 32, 5 %
  at 64, 10 % from P = 2^12 on.

  Args:
    base: the density at ``P = at``, in (0, 1].
    at: the device count ``base`` was measured at (an int >= 2).
    most: the largest density the rule gives, in [base, 1].

  Returns:
    A :class:`DensityRule`, to pass as ``density=`` to :func:`spardl_jax.spardl` or
    :func:`spardl_jax.sync_gradients` (a sparse method's density).

  Example:

    >>> rule = density_rule()
    >>> [round(rule(p), 4) for p in (8, 16, 32, 64)]
    [0.025, 0.0333, 0.0417, 0.05]
  """
  return DensityRule(base, at, most)


def as_rule(density) -> DensityRule | None:
  """The rule ``density`` names: a :class:`DensityRule` as it is, ``"auto"`` the default
  rule; None for a fixed density (or anything else)."""
  if isinstance(density, DensityRule):
    return density
  return density_rule() if isinstance(density, str) and density == AUTO else None


def at_devices(density, p: int | None, who: str):
  """``density`` for ``p`` devices: a number as it is, a rule (or ``"auto"``) evaluated at
  ``p``; a clear error for a rule where ``p`` is unknown or for any other text."""
  if isinstance(density, str) and density != AUTO:
    raise ValueError(f"{who}: density must be a number in (0, 1], {AUTO!r} or a "
                     f"density_rule(...), got {density!r}.")
  rule = as_rule(density)
  if rule is None:
    return density
  if p is None:
    raise ValueError(f"{who}: density={density!r} is picked from the number of devices; "
                     f"give p= (the devices of the data axis).")
  return rule(p)
