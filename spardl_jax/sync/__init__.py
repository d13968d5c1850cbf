"""The optax side: the method registry by name (:mod:`.methods`), the gradient-sync
transformation (:mod:`.transform`) and its stages (:mod:`.stages`, :mod:`.state`,
:mod:`.levels`), how gradients become one flat vector on any mesh (:mod:`.flat_layout`),
where parameter specs come from (:mod:`.specs`), where optimizer state lives
(:mod:`.placement`, :mod:`.data_parallel`), where a device takes its gradient
(:mod:`.point`), the outer loop that syncs rarely (:mod:`.outer`), the delayed sync's
look-ahead (:mod:`.lookahead`), the density rule (:mod:`.density`), restoring onto another
device count (:mod:`.refold`) and Adam around the sync (:mod:`.adam`)."""

__all__ = ['adam', 'data_parallel', 'density', 'flat_layout', 'levels', 'lookahead', 'methods',
           'outer', 'placement', 'point', 'refold', 'specs', 'stages', 'state', 'transform']
