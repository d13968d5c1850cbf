"""The allowed values of every choice option, for a command line or a config that offers them
(``argparse``'s ``choices=``): the library checks the same tuples and names them in its
errors; and :class:`DensityRule`, the type of a ``density=`` that follows the devices
(:func:`spardl_jax.density_rule`)."""

from spardl_jax.core.config import RESIDUAL_MODES, SAG_MODES, WIRE_FORMATS
from spardl_jax.sync.adam import SECOND_MOMENTS, SENDS
from spardl_jax.sync.density import DensityRule
from spardl_jax.sync.sync_options import BALANCES

__all__ = ['BALANCES', 'DensityRule', 'RESIDUAL_MODES', 'SAG_MODES', 'SECOND_MOMENTS', 'SENDS', 'WIRE_FORMATS']
