"""Adam's building blocks around a sync, for a recipe of one's own: the recipe itself is
:func:`spardl_jax.synced_adamw`, which chains them."""

from spardl_jax._src.recipes.synced_adam import scale_by_frozen_adam, scale_by_synced_adam

__all__ = ['scale_by_frozen_adam', 'scale_by_synced_adam']
