"""The parts of :func:`spardl_jax.gradient_point`, for a loop that needs one alone: the outer
loop's replica (:func:`replica_params`) and the look-ahead (:func:`predicted_params`)."""

from spardl_jax._src.recipes.prediction import predicted_params
from spardl_jax._src.recipes.outer import replica_params

__all__ = ['predicted_params', 'replica_params']
