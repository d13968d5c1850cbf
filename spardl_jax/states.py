"""The types of what the transformations keep and report, for ``isinstance`` checks, a
checkpoint's target and a state type of one's own to declare beside them: each lays out its
leaves as its class declares (``sj.opt_state_specs`` reads the declaration).

A state type of one's own declares where each field lives (:func:`layout` with a
:class:`Field` of a place, :data:`PLACES`) and how it moves onto another device count (a
fold rule, :data:`FOLD_RULES`; a method's per-device state declares its fold rules alone
with :func:`folds`); :func:`declare_layout` registers a function where the layout
depends on what an instance holds."""

from spardl_jax._src.core.protocol import (FOLD_RULES, FRESH, LIKE_PARAMS, MEAN, PER_DEVICE,
                                      PER_REPLICA, PLACES, REPLICATED, SAME, SUM, Field,
                                      declare_layout, folds, layout)
from spardl_jax._src.recipes.synced_adam import ScaleByFrozenAdamState, ScaleBySyncedAdamState
from spardl_jax._src.recipes.outer import DiLoCoState
from spardl_jax._src.sync.sync_state import SyncState, SyncStats

__all__ = ['DiLoCoState', 'ScaleByFrozenAdamState', 'ScaleBySyncedAdamState', 'SyncState',
           'SyncStats', 'layout', 'Field', 'declare_layout', 'folds', 'PLACES', 'PER_DEVICE',
           'PER_REPLICA', 'REPLICATED', 'LIKE_PARAMS', 'FOLD_RULES', 'SUM', 'SAME', 'MEAN',
           'FRESH']
