"""Progress on long work, for the trainer and every benchmark driver: a bar of the units done
(steps, runs, configurations) of the total, their rate and the time left, drawn on a terminal
and nowhere else, so a log file or a test's captured output gets no carriage-return lines.

``SPARDL_PROGRESS=0`` in the environment turns every bar off (the drivers' ``--no-progress``
does the same for one command). A bar nested under another (a run's steps under the runs of
a sweep) takes the second line and clears itself when its work ends.

Off a terminal (here) the bar passes its items through and draws nothing:

>>> from spardl_jax.tools.progress import bar
>>> done = 0
>>> for step in bar(range(3), desc="steps"):
...   done += 1
>>> with bar(total=5, desc="run", nested=True) as steps:
...   steps.update(5)
>>> done
3
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from tqdm import tqdm

__all__ = ['ENV', 'shown', 'bar']

ENV = "SPARDL_PROGRESS"


def shown(enabled: bool = True) -> bool:
  """Whether a bar is drawn: asked for (``enabled``, ``SPARDL_PROGRESS`` not ``0``) and
  standard error a terminal."""
  return enabled and os.environ.get(ENV, "1") != "0" and sys.stderr.isatty()


def bar(iterable: Iterable | None = None, *, total: int | None = None, desc: str,
        unit: str = "step", enabled: bool = True, nested: bool = False) -> tqdm:
  """A ``tqdm`` bar over ``iterable`` (or of ``total`` units, advanced by ``update``) that
  is drawn only where :func:`shown`; otherwise the same object passes the items through and
  its ``update`` and ``write`` cost nothing."""
  return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr,
              disable=not shown(enabled), dynamic_ncols=True,
              position=1 if nested else None, leave=not nested)
