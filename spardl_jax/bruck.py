"""Bruck all-gather inside a team, for any team size, in ``ceil(log2 q)`` rounds.

Executes :func:`spardl_jax.schedule.bruck_schedule`: at step ``s`` a worker sends the first
``min(2^(s-1), q - 2^(s-1))`` blocks it has gathered to ``rank - 2^(s-1)`` and appends the
blocks received from ``rank + 2^(s-1)``. Each worker sends ``q - 1`` blocks in total.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from spardl_jax import schedule


def bruck_allgather(block: jax.Array, *, q: int, p: int, axis_name) -> jax.Array:
  """Gathers one block from every worker of the team.

  Args:
    block: ``(1, W)`` this worker's block (e.g. a packed message), any dtype.
    q: team size (teams are contiguous ranks of ``axis_name``).
    p: number of workers on ``axis_name``.
    axis_name: the mesh axis.

  Returns:
    ``(q, W)``: row ``j`` is the block of team rank ``(rank + j) mod q`` (rotated frame).
  """
  gathered = block
  for st in schedule.bruck_schedule(q):
    received = jax.lax.ppermute(gathered[:st.count], axis_name,
                                perm=schedule.team_permutation(p, q, -st.shift))
    gathered = jnp.concatenate([gathered, received], axis=0)
  return gathered
