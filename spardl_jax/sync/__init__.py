"""The optax side: the method registry by name (:mod:`.methods`), the gradient-sync
transformation (:mod:`.transform`), the outer loop that syncs rarely (:mod:`.outer`) and the
sharding of their per-device state (:mod:`.data_parallel`)."""

__all__ = ['adam', 'data_parallel', 'levels', 'methods', 'outer', 'transform']
