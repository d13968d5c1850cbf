"""``python -m spardl_jax.launch``: the command line of :mod:`spardl_jax.parallel.launch`."""

import sys

from spardl_jax.parallel.launch import main

if __name__ == "__main__":
  sys.exit(main())
