"""The engine: the optax sync and nothing built over it. The method registry by name
(:mod:`.registry`), the transformation (:mod:`.transform`, its validated
:mod:`.settings`), the trace's one plan from a tree to the method's vector and back
(:mod:`.plan`, on :mod:`.packing`), the entries that hand the stages local shards
(:mod:`.entries`), the stages (:mod:`.stages`, :mod:`.levels`) and a delayed sync's pieces
(:mod:`.delay`), the state (:mod:`.sync_state`) and where state lives on the mesh
(:mod:`.placement`, :mod:`.data_parallel`), where parameter specs come from
(:mod:`.specs`), where a device takes its gradient (:mod:`.moves`) and a restore onto another
device count (:mod:`.refold`)."""
