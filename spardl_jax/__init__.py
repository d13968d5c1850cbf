"""spardl_jax: SparDL sparse all-reduce (ICDE 2024) for JAX data-parallel training."""

from spardl_jax import distributed, methods, schedule, traffic
from spardl_jax.allreduce import SparDLState, init_state, spardl_allreduce
from spardl_jax.config import BlockLayout, SparDLConfig
from spardl_jax.data_parallel import (
    init_opt_state,
    opt_state_shardings,
    opt_state_specs,
)
from spardl_jax.methods import sharded_allreduce
from spardl_jax.transform import (
    SyncState,
    SyncStats,
    spardl,
    sync_gradients,
    sync_stats,
)

__all__ = [
    "BlockLayout",
    "SparDLConfig",
    "SparDLState",
    "SyncState",
    "SyncStats",
    "distributed",
    "init_opt_state",
    "init_state",
    "methods",
    "opt_state_shardings",
    "opt_state_specs",
    "schedule",
    "sharded_allreduce",
    "spardl",
    "spardl_allreduce",
    "sync_gradients",
    "sync_stats",
    "traffic",
]
