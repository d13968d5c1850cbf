"""The allowed values of every choice option, for a command line or a config that offers them
(``argparse``'s ``choices=``): the library checks the same tuples and names them in its
errors."""

from spardl_jax.core.config import RESIDUAL_MODES, SAG_MODES, WIRE_FORMATS
from spardl_jax.sync.adam import SECOND_MOMENTS, SENDS

__all__ = ['RESIDUAL_MODES', 'SAG_MODES', 'SECOND_MOMENTS', 'SENDS', 'WIRE_FORMATS']
