"""``python -m spardl_jax.bench``: the command line of :mod:`spardl_jax.tools.bench`."""

import sys

from spardl_jax.tools.bench import main

if __name__ == "__main__":
  sys.exit(main())
