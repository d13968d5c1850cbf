"""``python -m spardl_jax.tools.bench``: :func:`spardl_jax.tools.bench.main`."""

import sys

from spardl_jax.tools.bench import main

if __name__ == "__main__":
  sys.exit(main())
