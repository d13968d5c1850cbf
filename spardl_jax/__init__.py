"""spardl_jax: SparDL sparse all-reduce (ICDE 2024) for JAX data-parallel training."""

from spardl_jax import schedule, traffic
from spardl_jax.allreduce import SparDLState, init_state, sharded_allreduce, spardl_allreduce
from spardl_jax.config import BlockLayout, SparDLConfig

__all__ = [
    "BlockLayout",
    "SparDLConfig",
    "SparDLState",
    "init_state",
    "schedule",
    "sharded_allreduce",
    "spardl_allreduce",
    "traffic",
]
