"""spardl_jax: SparDL sparse all-reduce (ICDE 2024) for JAX data-parallel training.

The package is layered; dependencies point one way:

* :mod:`spardl_jax.core` — the SparDL algorithm (layout, SRS, SAG, Bruck, GRES, costs) and
  the all-reduce protocol with its registry;
* :mod:`spardl_jax.baselines` — the competitors (dense, TopkA, TopkDSA, gTopk, Ok-Topk,
  PowerSGD, SparseLoCo);
* :mod:`spardl_jax.sync` — the method registry by name, the optax transformation and its
  stages, where parameter specs come from, and where optimizer state lives on the mesh;
* :mod:`spardl_jax.parallel` — multi-process setup, per-process batch rows, the launcher;
* :mod:`spardl_jax.tools` — HLO traffic and the one-sync benchmark.

The command lines are console scripts (``spardl-bench``, ``spardl-launch``,
``spardl-schedule``), the same as ``python -m`` of their modules (``spardl_jax.tools.bench``,
``.parallel.launch``, ``.core.schedule``).
"""

from spardl_jax import adam, checkpoint, collectives, options, points, states
from spardl_jax.core import cost, schedule
from spardl_jax.parallel import distributed, launch
from spardl_jax.parallel.dispatch import bounded_dispatch
from spardl_jax.sync import methods
from spardl_jax.sync.density import density_rule
from spardl_jax.sync.levels import density_warmup
from spardl_jax.sync.lookahead import lookahead
from spardl_jax.sync.adam import synced_adamw
from spardl_jax.sync.demo import demo
from spardl_jax.sync.data_parallel import (data_parallel_step, init_opt_state,
                                           opt_state_shardings, opt_state_specs,
                                           sync_state_filter)
from spardl_jax.sync.outer import diloco, sparseloco
from spardl_jax.sync.point import gradient_point
from spardl_jax.sync.specs import use_param_specs
from spardl_jax.sync.state import sync_stats
from spardl_jax.sync.transform import powersgd, spardl, sync_gradients

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
    "gradient_point",
    "distributed",
    "init_opt_state",
    "launch",
    "lookahead",
    "methods",
    "opt_state_shardings",
    "opt_state_specs",
    "options",
    "points",
    "powersgd",
    "synced_adamw",
    "schedule",
    "spardl",
    "sparseloco",
    "states",
    "sync_gradients",
    "sync_state_filter",
    "sync_stats",
    "use_param_specs",
)
