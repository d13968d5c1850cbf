"""The raw all-reduces, for a program of one's own without optax: SparDL's all-reduce of a
flat vector inside ``jax.shard_map`` (:func:`spardl_allreduce`, its :class:`SparDLConfig`,
:class:`SparDLState` and :class:`Blocks`), and any registered method over arrays that
hold one row per device (:func:`sharded`, its state from :func:`init_rows`;
:func:`sharded_allreduce` is SparDL's)."""

from spardl_jax._src.core.allreduce import SparDLState, spardl_allreduce
from spardl_jax._src.core.config import Blocks, SparDLConfig
from spardl_jax._src.sync.registry import abstract_rows, init_rows, sharded, sharded_allreduce

__all__ = ['Blocks', 'SparDLConfig', 'SparDLState', 'abstract_rows', 'init_rows',
           'sharded', 'sharded_allreduce', 'spardl_allreduce']
