"""``spardl-launch``: a job of several local processes (one ``jax.distributed`` rank each,
gloo between them), for tests and CPU runs of a multi-process program."""

import sys

from spardl_jax._src.parallel.launch import child_environment, free_port, launch, main

__all__ = ['child_environment', 'free_port', 'launch', 'main']

if __name__ == "__main__":
  sys.exit(main())
