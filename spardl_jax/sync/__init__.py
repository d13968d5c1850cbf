"""The optax side: the method registry by name (:mod:`.methods`), the gradient-sync
transformation (:mod:`.transform`) and its stages (:mod:`.stages`, :mod:`.state`,
:mod:`.levels`), how gradients become one flat vector on any mesh (:mod:`.flat_layout`),
where parameter specs come from (:mod:`.specs`), where optimizer state lives
(:mod:`.placement`, :mod:`.data_parallel`), the outer loop that syncs rarely (:mod:`.outer`)
and Adam with a frozen second moment (:mod:`.adam`)."""

__all__ = ['adam', 'data_parallel', 'flat_layout', 'levels', 'methods', 'outer', 'placement',
           'specs', 'stages', 'state', 'transform']
