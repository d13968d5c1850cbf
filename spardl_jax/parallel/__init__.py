"""Many processes: ``jax.distributed`` setup and host teams (:mod:`.distributed`), the rows
of a global batch each process reads (:mod:`.rows`), and the local launcher (:mod:`.launch`)."""

__all__ = ['dispatch', 'distributed', 'launch', 'rows']
