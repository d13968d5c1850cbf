"""The types of what the transformations keep and report, for ``isinstance`` checks, a
checkpoint's target and a state type of one's own to declare beside them: each lays out its
leaves as its class declares (``sj.opt_state_specs`` reads the declaration)."""

from spardl_jax.sync.adam import ScaleByFrozenAdamState, ScaleBySyncedAdamState
from spardl_jax.sync.outer import DiLoCoState
from spardl_jax.sync.state import SyncState, SyncStats

__all__ = ['DiLoCoState', 'ScaleByFrozenAdamState', 'ScaleBySyncedAdamState', 'SyncState',
           'SyncStats']
