"""The optax side: the method registry by name (:mod:`.methods`), the gradient-sync
transformation (:mod:`.transform`) and the sharding of its per-device state
(:mod:`.data_parallel`)."""

__all__ = ['adam', 'data_parallel', 'levels', 'methods', 'transform']
