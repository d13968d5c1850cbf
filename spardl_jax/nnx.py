"""Flax NNX: a data-parallel NNX program with a sync, by its optimizer (:class:`Optimizer`)
and its step's decorator (:func:`data_parallel`). Needs Flax; ``import spardl_jax`` does
not load it (``sj.nnx`` imports it when first used)."""

from spardl_jax._src.recipes.nnx_door import Optimizer, data_parallel

__all__ = ['Optimizer', 'data_parallel']
