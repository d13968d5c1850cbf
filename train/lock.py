"""One writer per run folder: an advisory lock on ``<--out>/.writer.lock``.

Two trainers writing the same ``--out`` would race on its metrics and on Orbax's checkpoint
folders (the second one died in a save with a traceback and left a temporary folder, and
``max_to_keep`` deletions of one could remove the other's). The first to start holds an
exclusive ``flock`` on the lock file for its whole run; a second one is refused before it
trains or writes, with the first one's process, host and start time. The kernel releases the
lock when its holder ends, however it ends, so a killed run never blocks the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time

LOCK = ".writer.lock"


class Busy(ValueError):
  """The run folder is held by another writer."""


@contextlib.contextmanager
def writer(out: str):
  """Holds ``out``'s lock for the block (``out`` exists); :class:`Busy` when another
  process holds it."""
  path = os.path.join(out, LOCK)
  handle = open(path, "a+")
  try:
    try:
      fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      handle.seek(0)
      holder = handle.read().strip() or "a process that has not written its name yet"
      raise Busy(f"--out {out!r} is being written by another run ({holder}); wait for it to "
                 f"end, or give another --out.") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
    handle.flush()
    yield
  finally:
    handle.close()  # closing releases the lock
