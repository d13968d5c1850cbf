"""The allowed values of every choice option, and reading a method spec from text, for a
command line or a config that offers them: the tuples for ``argparse``'s ``choices=`` (the
library checks the same and names them in its errors), :func:`parse` of
``'method:key=value:...'`` into a :class:`MethodSpec` (with :func:`split_spec`,
:func:`option_parser`, :func:`parse_density` and :func:`parse_teams` for single values),
and :class:`DensityRule`, the type of a ``density=`` that follows the devices
(:func:`spardl_jax.density_rule`)."""

from spardl_jax._src.core.config import RESIDUAL_MODES, SAG_MODES, WIRE_FORMATS
from spardl_jax._src.recipes.synced_adam import SECOND_MOMENTS, SENDS
from spardl_jax._src.core.density import AUTO, DensityRule
from spardl_jax._src.sync.registry import (MethodSpec, option_parser, parse, parse_density,
                                           parse_teams, split_spec)
from spardl_jax._src.sync.settings import BALANCES

__all__ = ['AUTO', 'BALANCES', 'DensityRule', 'MethodSpec', 'RESIDUAL_MODES', 'SAG_MODES',
           'SECOND_MOMENTS', 'SENDS', 'WIRE_FORMATS', 'option_parser', 'parse',
           'parse_density', 'parse_teams', 'split_spec']
