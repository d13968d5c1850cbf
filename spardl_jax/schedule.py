"""``python -m spardl_jax.schedule``: prints the round schedules of
:mod:`spardl_jax.core.schedule` (``spardl_jax.schedule`` the attribute is that module)."""

import sys

from spardl_jax.core.schedule import main

if __name__ == "__main__":
  sys.exit(main())
