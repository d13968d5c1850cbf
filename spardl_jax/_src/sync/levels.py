"""Synchronization levels: a dense warm-up and a density schedule, each compiled once.

A training run may synchronize densely for its first steps and then move through a few
densities (DGC's warm-up: 25 % -> 6.25 % -> 1.56 % -> 0.4 % -> the target). Each distinct
level is one all-reduce built once; the transformation picks the level of the current step
with ``lax.switch`` inside the one compiled train step, so crossing a level boundary never
recompiles (the same device-uniform dispatch as the B-SAG ``h`` ladder: the step count is
equal on every device, so every device takes the same branch and no collective is skipped).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

from spardl_jax._src.core.config import check_number
from spardl_jax._src.core.protocol import AllReduce
from spardl_jax._src.sync import registry as methods
from spardl_jax._src.core.density import DensityRule, as_rule

__all__ = ['DensitySchedule', 'Level', 'build', 'bind', 'density_warmup']

DensitySchedule = Sequence[tuple[int, float]]


class Level(NamedTuple):
  """One synchronization level.

  Attributes:
    start: the first step (0-based count of syncs) that uses it.
    allreduce: the all-reduce of this level.
    dense: True for the dense warm-up: ``pmean`` of the gradient plus the residual, which
      then empties (the mass is delivered, none is lost).
    density: the fraction of entries the level keeps (1.0 for dense; for a ``rule``, its
      value at the rule's own ``at`` until :func:`bind` knows the devices).
    rule: the :class:`~spardl_jax._src.core.density.DensityRule` the density comes from, or
      None for a fixed one.
  """

  start: int
  allreduce: AllReduce
  dense: bool
  density: float
  rule: DensityRule | None = None


def _check_schedule(schedule) -> list[tuple[int, float]]:
  """The ``(step, density)`` pairs of a schedule, validated: steps ints, the first 0,
  strictly increasing; densities numbers (each method checks its own range)."""
  try:
    pairs = [tuple(pair) for pair in schedule]
  except TypeError:
    pairs = None
  if not pairs or any(len(p) != 2 for p in pairs):
    raise ValueError(f"density must be a number, 'auto', a density_rule(...) or a non-empty "
                     f"list of (step, density) pairs, got {schedule!r}.")
  steps = [s for s, _ in pairs]
  for s in steps:
    check_number("density schedule", "every step", s, f"an int (steps {steps})",
                 integral=True)
  if steps[0] != 0 or any(b <= a for a, b in zip(steps, steps[1:])):
    raise ValueError(f"density schedule: steps must start at 0 and increase strictly, got "
                     f"{steps}.")
  for _, d in pairs:
    check_number("density schedule", "every density", d, "a number")
  return [(int(s), float(d)) for s, d in pairs]


def build(method: str, options: dict[str, Any], *, warmup_steps: int) -> list[Level]:
  """The levels of a sync: ``[dense warm-up] + one per density of the schedule``.

  Args:
    method: the registered method of the sparse levels.
    options: its options; ``options['density']`` may be a number or a schedule, a list of
      ``(step, density)`` pairs whose first step is 0 (from ``step`` on, use ``density``).
      Steps count from the first sync, warm-up included; levels that start inside the
      warm-up begin when it ends.
    warmup_steps: dense synchronizations before the first sparse level (an int >= 0).

  Raises:
    ValueError: naming the parameter and what it allows.
  """
  warmup_steps = check_number("", "warmup_steps", warmup_steps, "an int >= 0",
                              integral=True, accept=lambda w: w >= 0)
  density = options.get("density")
  rule = as_rule(density)
  schedule = ([(0, density)] if density is None or isinstance(density, numbers.Real) or rule
              else _check_schedule(density))
  levels = [Level(0, methods.make("dense"), True, 1.0)] if warmup_steps else []
  for i, (start, d) in enumerate(schedule):
    end = schedule[i + 1][0] if i + 1 < len(schedule) else math.inf
    if end <= warmup_steps:
      continue  # entirely inside the dense warm-up
    # A rule's level is built at the rule's own device count, which checks every other
    # option now; bind() rebuilds it for the devices the sync runs on.
    level_options = (dict(options) if density is None else
                     {**options, "density": rule(rule.at) if rule else d})
    allreduce = methods.make(method, **level_options)
    kept = allreduce.config.density if allreduce.sparse else 1.0
    levels.append(Level(max(start, int(warmup_steps)), allreduce, False, float(kept), rule))
  return levels


def bind(levels: list[Level], shapes, p: int) -> list[Level]:
  """``levels`` for the gradient's float leaf shapes (in flattening order; a method that
  sees one flat vector stays as it is) on ``p`` devices of the data axis: a rule's level
  takes its density for ``p``."""
  bound = []
  for level in levels:
    if level.rule is not None:
      density = level.rule(p)
      level = level._replace(density=density, allreduce=methods.from_config(
          dataclasses.replace(level.allreduce.config, density=density)))
    bound.append(level._replace(allreduce=level.allreduce.for_leaves(shapes)))
  return bound


def density_warmup(target: float, *, steps: int, start: float = 0.25, factor: float = 4.0,
                   at: int = 0) -> list[tuple[int, float]]:
  """DGC's exponential density warm-up as a schedule for ``density=``.

  The density starts at ``start`` and is divided by ``factor`` at equal intervals until the
  next division would go below ``target``; ``target`` holds from step ``at + steps`` on. With
  the defaults and ``target=0.001``: 25 %, 6.25 %, 1.56 %, 0.39 %, then 0.1 %.

  Args:
    target: the final density, in (0, 1].
    steps: how many steps the warm-up lasts (an int >= 1).
    start: the first density (>= target).
    factor: the ratio between consecutive densities (> 1).
    at: the step the warm-up begins (e.g. after a dense warm-up).

  Returns:
    ``[(step, density), ...]`` for :func:`~spardl_jax.spardl`'s ``density``.

  Example:

    >>> density_warmup(0.001, steps=400)
    [(0, 0.25), (100, 0.0625), (200, 0.015625), (300, 0.00390625), (400, 0.001)]

  References:
    Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
    Distributed Training", ICLR 2018, Section 3.3 (warm-up training).
  """
  who = "density_warmup"
  target = check_number(who, "target", target, "in (0, 1]", accept=lambda t: 0 < t <= 1)
  steps = check_number(who, "steps", steps, "an int >= 1", integral=True,
                       accept=lambda s: s >= 1)
  start = check_number(who, "start", start, "in [target, 1]",
                       accept=lambda s: target <= s <= 1)
  factor = check_number(who, "factor", factor, "a finite number > 1",
                        accept=lambda f: 1 < f < math.inf)
  at = check_number(who, "at", at, "an int >= 0", integral=True, accept=lambda a: a >= 0)
  densities = [float(start)]
  while densities[-1] / factor >= target:
    densities.append(densities[-1] / factor)
  densities = [d for d in densities if d != target][:steps]  # each level lasts >= 1 step
  if not densities:  # start == target: nothing to warm up
    return [(0, float(target))]
  each = steps // len(densities)
  pairs = [(0, float(target))] if at else []
  pairs += [(at + i * each, d) for i, d in enumerate(densities)]
  return pairs + [(at + steps, float(target))]
