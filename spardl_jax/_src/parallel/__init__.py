"""Many processes: ``jax.distributed`` setup and host teams (:mod:`.distributed`), the rows
of a global batch each process reads (:mod:`.rows`), the local launcher (:mod:`.launch`)
and a bound on dispatch for simulated CPU devices (:mod:`.dispatch`)."""
