"""Saving and restoring the sync's state from a user's own loop: ``sj.checkpoint``.

The state saves and restores with any checkpointer on the same devices (Orbax's included:
the resumed run is bit-identical). Onto another number of devices, restore it as saved
(:func:`as_saved` makes the target) and :func:`refold` it: every per-device leaf is rebuilt by
the rule its state type declares (:func:`fold_rules`), residual mass conserved.
"""

from spardl_jax._src.sync.placement import fold_rules
from spardl_jax._src.sync.refold import RefoldError, as_saved, fold_sum, paths, refold

__all__ = ['RefoldError', 'as_saved', 'fold_rules', 'fold_sum', 'paths', 'refold']
