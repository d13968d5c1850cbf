"""Orbax checkpoints of the whole train state, per-device residuals included.

The state is saved with its shardings: the ``(P, n)`` residuals keep every device's row, so a
restore continues bit-identically (same next loss, same next residuals). The epoch history is
saved beside it, so a resumed run's metrics cover every epoch.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


def manager(directory: str, *, max_to_keep: int = 2) -> ocp.CheckpointManager:
  """A checkpoint manager writing one checkpoint per epoch under ``directory``."""
  return ocp.CheckpointManager(os.path.abspath(directory),
                               options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))


def save(mgr: ocp.CheckpointManager, epoch: int, state, history: list) -> None:
  """Saves ``state`` and the epoch ``history`` as checkpoint ``epoch`` and waits for it."""
  mgr.save(epoch, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                          history=ocp.args.JsonSave(history)))
  mgr.wait_until_finished()


def restore_latest(mgr: ocp.CheckpointManager, like) -> tuple[int, object, list] | None:
  """``(epoch, state, history)`` of the latest checkpoint, or None when there is none.

  Args:
    mgr: the manager.
    like: a state of the same structure; its shapes, dtypes and shardings are restored.
  """
  epoch = mgr.latest_step()
  if epoch is None:
    return None
  abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), like)
  restored = mgr.restore(epoch, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract), history=ocp.args.JsonRestore()))
  return epoch, restored["state"], list(restored["history"])
