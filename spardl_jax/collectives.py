"""The raw all-reduces, for a program of one's own without optax: SparDL's all-reduce of a
flat vector inside ``jax.shard_map`` (:func:`spardl_allreduce`, its :class:`SparDLConfig`,
:class:`SparDLState` and :class:`BlockLayout`), and any registered method as one
``jit(shard_map(...))`` over ``(P, n)`` rows (:func:`sharded_allreduce`)."""

from spardl_jax.core.allreduce import SparDLState, spardl_allreduce
from spardl_jax.core.config import BlockLayout, SparDLConfig
from spardl_jax.sync.methods import sharded_allreduce

__all__ = ['BlockLayout', 'SparDLConfig', 'SparDLState', 'sharded_allreduce', 'spardl_allreduce']
