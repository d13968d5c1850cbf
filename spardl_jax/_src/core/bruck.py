"""Bruck all-gather over a group of workers, for any group size, in ``ceil(log2 g)`` rounds.

Executes :func:`spardl_jax._src.core.schedule.bruck_schedule`: at step ``s`` a worker sends the first
``min(2^(s-1), g - 2^(s-1))`` blocks it has gathered to the worker ``2^(s-1)`` places before
it and appends the blocks received from the one ``2^(s-1)`` places after it. Each worker sends
``g - 1`` blocks in total. The group is a team (contiguous ranks) or, for B-SAG, the workers
of one position in every team.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from spardl_jax._src.core import schedule

__all__ = ['bruck_allgather']


def bruck_allgather(block: jax.Array, *, size: int, axis_name,
                    permutation: Callable[[int], list[tuple[int, int]]]) -> jax.Array:
  """Gathers one block from every worker of the group.

  Args:
    block: ``(1, W)`` this worker's block (e.g. a packed message), any dtype.
    size: the group size ``g``.
    axis_name: the mesh axis.
    permutation: ``shift -> (source, target) pairs`` moving every worker ``shift`` places
      inside its group, e.g. ``lambda s: schedule.team_permutation(p, q, s)``.

  Returns:
    ``(g, W)``: row ``j`` is the block of the worker ``j`` places after this one in its
    group (the rotated frame).
  """
  gathered = block
  for st in schedule.bruck_schedule(size):
    received = jax.lax.ppermute(gathered[:st.count], axis_name, perm=permutation(-st.shift))
    gathered = jnp.concatenate([gathered, received], axis=0)
  return gathered
