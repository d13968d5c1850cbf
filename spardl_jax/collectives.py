"""The raw all-reduces, for a program of one's own without optax: SparDL's all-reduce of a
flat vector inside ``jax.shard_map`` (:func:`spardl_allreduce`, its :class:`SparDLConfig`,
:class:`SparDLState` and :class:`BlockLayout`), and any registered method as one
``jit(shard_map(...))`` over ``(P, n)`` rows (:func:`sharded_allreduce`)."""

import jax

from spardl_jax.core.allreduce import SparDLState, spardl_allreduce
from spardl_jax.core.config import BlockLayout, SparDLConfig
from spardl_jax.core.nonfinite import NonFinite
from spardl_jax.sync.methods import from_config, sharded

__all__ = ['BlockLayout', 'SparDLConfig', 'SparDLState', 'sharded_allreduce', 'spardl_allreduce']


def sharded_allreduce(config: SparDLConfig, mesh: jax.sharding.Mesh, axis_name: str = "data",
                      *, nonfinite: NonFinite = "skip"):
  """SparDL with ``config`` as one ``jit(shard_map(...))`` over ``(P, n)`` gradient rows and
  ``(P, ...)`` state rows (:func:`spardl_jax.methods.sharded` of the method
  ``from_config(config)``); the state from ``sj.methods.init_rows(from_config(config), P,
  n)``."""
  return sharded(from_config(config), mesh, axis_name, nonfinite=nonfinite)
