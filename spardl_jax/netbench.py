"""``python -m spardl_jax.netbench``: the command line of :mod:`spardl_jax.tools.netbench`."""

import sys

from spardl_jax.tools.netbench import main

if __name__ == "__main__":
  sys.exit(main())
