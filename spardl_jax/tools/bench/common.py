"""What the benchmarks of :mod:`spardl_jax.tools.bench` share: the methods they can time,
the paper's sizes, each method's variants at ``P`` and a median of warmed-up calls."""

from __future__ import annotations

import statistics
import time

import jax

from spardl_jax._src.core import cost, protocol
from spardl_jax._src.sync import registry as methods

__all__ = ['flat_methods', 'PAPER_SIZES', 'variants', 'median_seconds']


def flat_methods() -> tuple[str, ...]:
  """The registered methods that sync one flat vector. PowerSGD needs the leaf shapes of a
  model (it all-reduces a flat vector dense); the trainer benchmarks it."""
  return tuple(m for m in methods.names()
               if not protocol.registered()[m].leafwise)


PAPER_SIZES = [14_700_000, 20_100_000, 23_500_000, 9_200_000, 35_200_000, 66_000_000,
               133_500_000]


def median_seconds(fn, x, state, repeats: int) -> float:
  """Median wall time of ``fn(x, state)``, the returned state fed back (as training does),
  after one warm-up call."""
  _, state = jax.block_until_ready(fn(x, state))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    _, state = jax.block_until_ready(fn(x, state))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _teams(args, p: int) -> list[int]:
  if args.teams == "all":
    return cost.team_counts(p, args.sag)
  bad = [d for d in args.teams if d not in cost.team_counts(p)]
  if bad:
    raise SystemExit(f"--teams {bad} do not divide --devices {p}; allowed: "
                     f"{cost.team_counts(p)}")
  return args.teams


def variants(args, p: int):
  """``(label, method, teams)`` for every method (SparDL once per team count and wire
  format)."""
  for name in args.methods:
    if name == "spardl":
      for d in _teams(args, p):
        for wire in args.wire:
          label = "spardl" + ("" if wire == "exact" else f" {wire}") + (
              "" if d == 1 else f" d={d} ({cost.sag_kind(d, args.sag)[0].upper()}-SAG)")
          yield label, methods.make("spardl", density=args.density, teams=d, sag=args.sag,
                                    wire=wire), d
    else:  # a sparse method at --density; the others with their defaults
      yield name, methods.make(name, **({"density": args.density}
                                        if methods.is_sparse(name) else {})), None
