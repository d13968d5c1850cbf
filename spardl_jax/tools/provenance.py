"""Where a measurement was taken, recorded beside its raw output: the commit, the date, the
machine, the library versions and the selection method the library picks there."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata
from typing import Any

import jax

from spardl_jax._src.sync import registry as methods

__all__ = ['provenance']


def provenance() -> dict[str, Any]:
  """What a raw output records of where it was measured: the commit (and whether the tree
  had uncommitted changes), the date, the machine, the library versions and the top-k
  selection method the library picks there."""
  def git(*args):
    try:
      return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.SubprocessError):
      return ""

  return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain",
                                                                   "--untracked-files=no")),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                     f"{jax.devices()[0].device_kind}",
          "versions": {name: metadata.version(name) for name in
                       ("jax", "jaxlib", "flax", "optax", "numpy")},
          "selection": methods.default_selection()}
