"""The options of one gradient sync, validated once when it is built: every bad value is
refused here, before anything is traced."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from spardl_jax._src.core import nonfinite as nonfinite_policy
from spardl_jax._src.core.config import check_number
from spardl_jax._src.core.nonfinite import NonFinite
from spardl_jax._src.sync import levels
from spardl_jax._src.sync.specs import check_same_specs, check_spec_tree

__all__ = ['SyncOptions', 'check_dense_leaves', 'BALANCES']


@dataclasses.dataclass(frozen=True, eq=False)
class SyncOptions:
  """The options of one :func:`spardl_jax.sync_gradients`, validated once (see its
  docstring for each); ``levels`` are the sync's levels, not yet bound to leaf shapes."""

  method: str
  levels: tuple[levels.Level, ...]
  axis_name: str = "data"
  axis_size: int | None = None
  nonfinite: NonFinite = "skip"
  momentum: float | None = None
  momentum_masking: bool = True
  param_specs: Any = None
  local_axis: str | None = None
  residual_decay: float | None = None
  dense_leaves: Any = None
  delay: int = 0
  balance: str | None = None

  def __post_init__(self):
    who = "sync_gradients"
    nonfinite_policy.check_policy(who, self.nonfinite)
    if isinstance(self.delay, bool) or self.delay not in (0, 1):
      raise ValueError(f"sync_gradients: delay must be 0 (each step's own gradient) or 1 "
                       f"(each step sends the last step's gradient), got {self.delay!r}.")
    check_dense_leaves(self.dense_leaves)
    if self.balance is not None and self.balance not in BALANCES:
      raise ValueError(f"{who}: balance must be None (one selection over the whole vector) or "
                       f"{' or '.join(map(repr, BALANCES))} (each leaf scaled to the "
                       f"vector's size first), got {self.balance!r}.")
    if self.dense_leaves is not None and self.momentum is not None:
      raise ValueError(f"{who}: dense_leaves={self.dense_leaves!r} with momentum="
                       f"{self.momentum}: DGC's momentum correction keeps one velocity for "
                       f"the sparse vector only; use the optimizer's momentum after the sync "
                       f"(optax.sgd(lr, momentum=...)), or drop dense_leaves.")
    if self.residual_decay is not None:
      check_number(who, "residual_decay", self.residual_decay, "None or a number in [0, 1]",
                   accept=lambda b: 0 <= b <= 1)
    if self.momentum is not None:
      check_number(who, "momentum", self.momentum, "None or a number in [0, 1)",
                   accept=lambda m: 0 <= m < 1)
    if not isinstance(self.momentum_masking, bool):
      raise ValueError(f"{who}: momentum_masking must be True or False, got "
                       f"{self.momentum_masking!r}.")
    if self.axis_size is not None:
      check_number(who, "axis_size", self.axis_size, "a positive int", integral=True,
                   accept=lambda p: p >= 1)
    if self.local_axis is not None and (not isinstance(self.local_axis, str)
                                        or self.local_axis == self.axis_name):
      raise ValueError(f"{who}: local_axis must be None or the name of a mesh axis other "
                       f"than axis_name={self.axis_name!r}, got {self.local_axis!r}.")

  def is_dense(self, shape: tuple[int, ...]) -> bool:
    """Whether a float leaf of this (local) shape is averaged densely, outside the method."""
    rule = self.dense_leaves
    if rule is None:
      return False
    if rule == "vectors":
      return len(shape) <= 1
    if isinstance(rule, int):
      return math.prod(shape) < rule
    return bool(rule(shape))

  @property
  def data_axes(self) -> tuple[str, ...]:
    """The axes the sync reduces over: the data axis, and a host's ``local_axis``."""
    return (self.axis_name,) if self.local_axis is None else (self.axis_name, self.local_axis)

  @property
  def reaches_result(self) -> bool:
    """Whether a non-finite input reaches the result at every level (no agreement round)."""
    return all(level.allreduce.nonfinite_reaches_result for level in self.levels)

  def given_specs(self, door, door_name: str, who: str):
    """The parameters' specs: the transformation's own ``param_specs``, else what came
    through ``door`` (``tx.update``'s extra argument, or ``use_param_specs`` for init);
    where both came, they must agree."""
    check_spec_tree(door, f"{who} ({door_name})", data_axes=self.data_axes)
    if self.param_specs is None:
      return door
    check_spec_tree(self.param_specs, who, data_axes=self.data_axes)
    if door is not None:
      check_same_specs(self.param_specs, door, door_name, who)
    return self.param_specs


# What ``balance`` may scale each entry by before a method selects among them: its leaf's
# power of two (stages.leaf_scales).
BALANCES = ("leaves",)

DENSE_LEAVES = ("vectors", "an int N (leaves of fewer than N entries)",
                "a callable taking a leaf's shape and returning True to keep it dense")


def check_dense_leaves(rule) -> None:
  """``dense_leaves`` is None, ``"vectors"``, a positive int or a callable."""
  if (rule is None or rule == "vectors" or callable(rule)
      or (isinstance(rule, int) and not isinstance(rule, bool) and rule >= 1)):
    return
  raise ValueError(f"sync_gradients: dense_leaves must be None, {', '.join(DENSE_LEAVES)}; "
                   f"got {rule!r}.")
