"""``python -m spardl_jax.schedule Q``: prints the round schedules of a team of Q workers.

The schedules live in :mod:`spardl_jax.core.schedule` (``spardl_jax.schedule``, the package
attribute, is that module); this file is the command line, and re-exports the same names
for code that imports ``spardl_jax.schedule`` as a module.
"""

import sys

from spardl_jax.core.schedule import *  # noqa: F403
from spardl_jax.core.schedule import main

if __name__ == "__main__":
  sys.exit(main())
