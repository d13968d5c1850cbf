"""Static communication schedules of SparDL: Spar-Reduce-Scatter, Bruck all-gather and the
cross-team steps of Spar-All-Gather (R-SAG, B-SAG).

Pure Python (no JAX), so a schedule can be printed and tested on its own; the JAX code in
:mod:`spardl_jax._src.core.srs` and :mod:`spardl_jax._src.core.bruck` executes exactly these steps.

Both schedules work in a team of ``q`` workers and in the *rotated frame* of
``docs/design.md``: worker ``w``'s position ``j`` holds global block ``(w + j) mod q``.

Run ``python -m spardl_jax.schedule 6`` to print who sends which blocks to whom.
"""

from __future__ import annotations

import dataclasses
import sys

__all__ = ['num_steps', 'SRSStep', 'BruckStep', 'srs_schedule', 'bruck_schedule',
           'team_permutation', 'cross_team_permutation', 'recursive_doubling_permutation',
           'h_ladder', 'format_schedule', 'main']


def num_steps(q: int) -> int:
  """``ceil(log2 q)``: the number of rounds of SRS and of Bruck for ``q`` workers."""
  if q < 1:
    raise ValueError(f"the team size must be >= 1, got {q}.")
  return (q - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class SRSStep:
  """One Spar-Reduce-Scatter step (the same for every worker of the team).

  Worker ``w`` sparsifies and sends the blocks at its positions ``[start, stop)`` (the bag)
  to worker ``w + shift``; what it receives from ``w - shift`` lands on its positions
  ``[0, stop - start)``.
  """

  step: int   # 1-based, as in the paper
  shift: int  # the distance delta = 2**(l - step)
  start: int  # first position of the bag
  stop: int   # one past the last position of the bag

  @property
  def size(self) -> int:
    """Number of blocks in the bag."""
    return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class BruckStep:
  """One Bruck all-gather step: worker ``w`` sends the first ``count`` gathered blocks
  (positions ``[0, count)``) to ``w - shift``, and appends what ``w + shift`` sends."""

  step: int   # 1-based
  shift: int  # 2**(step - 1)
  count: int  # blocks sent, min(shift, q - shift)


def srs_schedule(q: int) -> list[SRSStep]:
  """The SRS steps for a team of ``q`` workers (``ceil(log2 q)`` of them).

  Step 1 uses distance ``2**(l-1)`` and the bag ``[2**(l-1), q)`` (``E = q - 2**(l-1)``
  blocks); step ``s > 1`` uses distance ``delta = 2**(l-s)`` and the bag ``[delta, 2 delta)``.
  Every position ``1..q-1`` is sent exactly once; position 0 (the worker's own block) stays.
  """
  l = num_steps(q)
  steps = []
  for s in range(1, l + 1):
    shift = 2 ** (l - s)
    stop = q if s == 1 else 2 * shift
    steps.append(SRSStep(step=s, shift=shift, start=shift, stop=stop))
  return steps


def bruck_schedule(q: int) -> list[BruckStep]:
  """The Bruck all-gather steps for a team of ``q`` workers (``ceil(log2 q)`` of them)."""
  return [
      BruckStep(step=s + 1, shift=2**s, count=min(2**s, q - 2**s))
      for s in range(num_steps(q))
  ]


def team_permutation(p: int, q: int, shift: int) -> list[tuple[int, int]]:
  """``(source, target)`` pairs sending each rank to ``rank + shift`` inside its team.

  Teams are the contiguous rank ranges ``[t q, (t + 1) q)`` of ``p`` ranks; the shift is
  taken modulo ``q`` inside each team. This is the ``perm`` argument of ``jax.lax.ppermute``.
  """
  if p % q:
    raise ValueError(f"team size {q} does not divide the worker count {p}.")
  return [(t + i, t + (i + shift) % q) for t in range(0, p, q) for i in range(q)]


def cross_team_permutation(p: int, q: int, shift: int) -> list[tuple[int, int]]:
  """Pairs sending worker ``(team t, position r)`` to ``(team (t + shift) mod d, r)``.

  The B-SAG Bruck all-gather runs over the ``d = p / q`` workers of one position.
  """
  d = p // q
  return [(t * q + r, ((t + shift) % d) * q + r) for t in range(d) for r in range(q)]


def recursive_doubling_permutation(p: int, q: int, step: int) -> list[tuple[int, int]]:
  """R-SAG step ``step`` (0-based): team ``t`` exchanges with team ``t XOR 2**step``, same
  position. Each pair appears in both directions."""
  d = p // q
  if d & (d - 1) or 2**step >= d:
    raise ValueError(f"recursive doubling needs a power-of-two team count > 2**{step}, "
                     f"got d={d}.")
  return [(t * q + r, (t ^ 2**step) * q + r) for t in range(d) for r in range(q)]


def h_ladder(kb: int, d: int, ratio: float = 1.08) -> tuple[int, ...]:
  """The static B-SAG message sizes ``h``: ``ceil(kb / d)`` to ``kb``, geometric by ``ratio``.

  Each size is one ``lax.switch`` branch, compiled once; the adaptive ``h`` is rounded up to
  the next size, so the bytes on the wire follow ``h`` within ``ratio``.
  """
  lo = -(-kb // d)
  sizes, h = [lo], float(lo)
  while sizes[-1] < kb:
    h *= ratio
    sizes.append(min(kb, max(sizes[-1] + 1, int(h + 0.999999))))
  return tuple(sizes)


def format_schedule(q: int) -> str:
  """A human-readable table of both schedules for a team of ``q`` workers."""
  lines = [f"SparDL schedules for a team of {q} workers "
           f"({num_steps(q)} SRS + {num_steps(q)} Bruck rounds)"]
  lines.append("Spar-Reduce-Scatter (rotated frame: position j of worker w = block (w+j) mod q)")
  for st in srs_schedule(q):
    lines.append(f"  step {st.step}: distance {st.shift}, bag positions "
                 f"[{st.start}, {st.stop}) = {st.size} block(s)")
    for w in range(q):
      blocks = [(w + j) % q for j in range(st.start, st.stop)]
      lines.append(f"    worker {w} -> worker {(w + st.shift) % q}: blocks {blocks}")
  lines.append("Bruck all-gather of the (offset, value) pairs")
  for bruck in bruck_schedule(q):
    lines.append(f"  step {bruck.step}: distance {bruck.shift}, {bruck.count} block(s)")
    for w in range(q):
      blocks = [(w + j) % q for j in range(bruck.count)]
      lines.append(f"    worker {w} -> worker {(w - bruck.shift) % q}: blocks {blocks}")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 1 or not argv[0].isdigit() or int(argv[0]) < 1:
    print("usage: python -m spardl_jax.schedule WORKERS   (a positive integer)",
          file=sys.stderr)
    return 2
  print(format_schedule(int(argv[0])))
  return 0


if __name__ == "__main__":
  sys.exit(main())
