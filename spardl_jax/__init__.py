"""spardl_jax: SparDL sparse all-reduce (ICDE 2024) for JAX data-parallel training.

Everything a user needs is a name here or in one of the namespaces below, each a door file
of its own with an ``__all__``; the implementation lives under ``spardl_jax._src``, which is
not public. The transformations: :func:`spardl`, :func:`sync_gradients` (any registered
method), :func:`powersgd`, :func:`synced_adamw`, :func:`demo`, :func:`diloco`,
:func:`sparseloco`, :func:`weight_prediction`; the train step and its state:
:func:`data_parallel_step`, :func:`init_opt_state`, :func:`opt_state_specs`,
:func:`opt_state_shardings`, :func:`gradient_point`, :func:`sync_stats`,
:func:`sync_state_filter`, :func:`use_param_specs`, :func:`bounded_dispatch`; densities:
:func:`density_rule`, :func:`density_warmup`.

Namespaces: ``adam`` (Adam's pieces around a sync), ``checkpoint`` (restore onto another
device count), ``collectives`` (the raw all-reduces), ``cost`` (the paper's cost table and
the alpha-beta model), ``distributed`` and ``launch`` (many processes), ``methods`` (the
registry and the protocol a method implements), ``options`` (choice lists and method specs
from text), ``points`` (where a device takes its gradient), ``schedule`` (SparDL's rounds),
``states`` (the state types and their declared layouts), ``nnx`` (a Flax NNX program's
optimizer and step decorator; it imports Flax when first used). The tools (``spardl_jax.tools``:
HLO traffic, ``spardl-bench``) are imported where used, never by ``import spardl_jax``.
"""

from spardl_jax import (adam, checkpoint, collectives, cost, distributed, launch, methods, options,
                        points, schedule, states)
from spardl_jax._src.parallel.dispatch import bounded_dispatch
from spardl_jax._src.recipes.demo import demo
from spardl_jax._src.recipes.outer import diloco, sparseloco
from spardl_jax._src.recipes.prediction import weight_prediction
from spardl_jax._src.recipes.synced_adam import synced_adamw
from spardl_jax._src.sync.data_parallel import (data_parallel_step, init_opt_state,
                                                opt_state_shardings, opt_state_specs,
                                                sync_state_filter)
from spardl_jax._src.core.density import density_rule
from spardl_jax._src.sync.levels import density_warmup
from spardl_jax._src.sync.moves import gradient_point
from spardl_jax._src.sync.specs import use_param_specs
from spardl_jax._src.sync.sync_state import sync_stats
from spardl_jax._src.sync.transform import powersgd, spardl, sync_gradients

__all__ = (
    "adam",
    "bounded_dispatch",
    "checkpoint",
    "collectives",
    "cost",
    "data_parallel_step",
    "demo",
    "density_rule",
    "density_warmup",
    "diloco",
    "distributed",
    "gradient_point",
    "init_opt_state",
    "launch",
    "methods",
    "opt_state_shardings",
    "opt_state_specs",
    "options",
    "points",
    "powersgd",
    "schedule",
    "spardl",
    "sparseloco",
    "states",
    "sync_gradients",
    "sync_state_filter",
    "sync_stats",
    "synced_adamw",
    "use_param_specs",
    "weight_prediction",
    "nnx",
)


def __getattr__(name):
  # sj.nnx needs Flax, which the library does not: imported when first used.
  if name == "nnx":
    import importlib
    return importlib.import_module("spardl_jax.nnx")
  raise AttributeError(f"module 'spardl_jax' has no attribute {name!r}")
