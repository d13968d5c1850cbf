"""The engine: the optax sync and nothing built over it. The method registry by name
(:mod:`.registry`), the transformation (:mod:`.transform`, its validated
:mod:`.settings`) and its stages (:mod:`.entries`, :mod:`.stages`, :mod:`.levels`), how
gradients become one flat vector on any mesh (:mod:`.flat_layout`), the state
(:mod:`.sync_state`) and where state lives on the mesh (:mod:`.placement`,
:mod:`.data_parallel`), where parameter specs come from (:mod:`.specs`), where a device
takes its gradient (:mod:`.moves`), the density rule (:mod:`.density`) and a restore onto
another device count (:mod:`.refold`)."""
