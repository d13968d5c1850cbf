"""The parts of :func:`spardl_jax.gradient_point`, for a loop that needs one alone: the outer
loop's replica (:func:`replica_params`) and the look-ahead (:func:`lookahead_params`)."""

from spardl_jax.sync.lookahead import lookahead_params
from spardl_jax.sync.outer import replica_params

__all__ = ['lookahead_params', 'replica_params']
