"""Many processes: ``jax.distributed`` set up from the launcher's environment, the host teams
SparDL's B-SAG can follow, and the rows of a global batch each process reads and places."""

from spardl_jax._src.parallel.distributed import (environment, host_teams, initialize,
                                                  process_rows, shard_rows)

__all__ = ['environment', 'host_teams', 'initialize', 'process_rows', 'shard_rows']
