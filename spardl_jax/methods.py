"""The all-reduce methods by name, for a method's author and for code that picks one:
the registry (:func:`names`, :func:`make`, :func:`from_config`, :func:`is_sparse`,
:func:`describe`; :func:`default_selection` names the top-k selection this backend runs)
and the protocol a method implements (:class:`AllReduce`, its :class:`Cost`, the
:class:`FlatVector` defaults, :func:`register`, and :func:`check_number` for its options'
errors; docs/new-method.md). Reading a method spec from text (``'oktopk:tau=16'``) is
:mod:`spardl_jax.options`'; one method over arrays of per-device rows is
:func:`spardl_jax.collectives.sharded`."""

from spardl_jax._src.core.config import check_number
from spardl_jax._src.core.protocol import AllReduce, Cost, FlatVector, HasResidual, register
from spardl_jax._src.sync.registry import (default_selection, describe, from_config, is_sparse,
                                           make, names)

__all__ = ['AllReduce', 'Cost', 'FlatVector', 'HasResidual', 'check_number', 'default_selection',
           'describe',
           'from_config', 'is_sparse', 'make', 'names', 'register']
