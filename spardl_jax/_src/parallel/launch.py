"""Local multi-process launcher: ``python -m spardl_jax.launch --processes 4 -- CMD ...``.

Starts ``--processes`` copies of ``CMD`` on this machine as one ``jax.distributed`` job
(gloo carries the collectives between CPU processes), each with ``--devices-per-process``
CPU devices. It picks a free port on 127.0.0.1 for the coordinator, streams every process's
output with a ``[rank]`` prefix, and on the first failure (or ``--timeout``, or a SIGTERM to
the launcher) stops them all and exits non-zero. The processes find their role in the
environment variables that :func:`spardl_jax.distributed.initialize` reads.

Usage, in a shell::

  python -m spardl_jax.launch --processes 4 --devices-per-process 2 -- \\
      python -m train --devices 8 --epochs 2
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from spardl_jax._src.parallel import distributed

__all__ = ['free_port', 'child_environment', 'launch', 'main']


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _stream(rank: int, pipe, out) -> None:
  for line in iter(pipe.readline, b""):
    out.write(f"[{rank}] {line.decode(errors='replace')}")
    out.flush()


def _stop(procs) -> None:
  """SIGTERM every process group still alive, then SIGKILL after 5 s."""
  for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
      try:
        os.killpg(p.pid, sig)
      except ProcessLookupError:
        pass
    deadline = time.monotonic() + wait
    while wait and any(p.poll() is None for p in alive) and time.monotonic() < deadline:
      time.sleep(0.1)
  for p in procs:  # reap them: no zombie outlives the launcher
    try:
      p.wait(timeout=5)
    except subprocess.TimeoutExpired:
      pass


class _Terminated(Exception):
  """The launcher got SIGTERM."""


def _terminate(signum, frame):
  del frame
  raise _Terminated(signum)


def child_environment() -> dict[str, str]:
  """This process's environment for a rank: ``XLA_FLAGS`` without a simulated device count
  (each rank gets its own from ``SPARDL_LOCAL_DEVICES``); other XLA flags pass through."""
  env = dict(os.environ)
  flags = [f for f in env.pop("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  return env


def launch(command: list[str], *, processes: int, devices_per_process: int = 1,
           timeout: float | None = None, host: str = "127.0.0.1", out=None,
           prefix: Callable[[int], list[str]] | None = None) -> int:
  """Runs ``command`` as ``processes`` ranks of one job; returns the job's exit code.

  0 when every rank exits 0; otherwise the first failing rank's code (124 on timeout).
  A SIGTERM to this process (in the main thread) stops every rank, then raises
  ``SystemExit(143)``: the ranks run in their own sessions, so they would outlive it.
  ``host`` is the coordinator's address (rank 0 must be reachable there); ``prefix(rank)``
  is put before the command of each rank, e.g. ``['ip', 'netns', 'exec', 'ns0']`` to run it
  in a network namespace (the repository's `benchmarks/netbench.py`).

  Raises:
    ValueError: for ``processes`` or ``devices_per_process`` below 1, or a ``timeout`` that
      is not a positive finite number of seconds.
  """
  if processes < 1 or devices_per_process < 1:
    raise ValueError(f"launch: processes and devices_per_process must be >= 1, got "
                     f"{processes} and {devices_per_process}.")
  if timeout is not None and not 0 < timeout < float("inf"):
    raise ValueError(f"launch: timeout must be a positive, finite number of seconds, got "
                     f"{timeout!r}.")
  out = out or sys.stdout
  coordinator = f"{host}:{free_port()}"
  env = child_environment()
  procs, threads = [], []
  deadline = None if timeout is None else time.monotonic() + timeout
  code: int | None = 0
  # The ranks run in their own sessions (a signal to one must not hit the launcher), so a
  # SIGTERM to the launcher would orphan them: turn it into the cleanup below.
  handler = None
  if threading.current_thread() is threading.main_thread():
    handler = signal.signal(signal.SIGTERM, _terminate)
  try:
    for rank in range(processes):
      child_env = dict(env, **distributed.environment(coordinator, processes, rank,
                                                       devices_per_process))
      proc = subprocess.Popen([*(prefix(rank) if prefix else []), *command], env=child_env,
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True)
      procs.append(proc)
      thread = threading.Thread(target=_stream, args=(rank, proc.stdout, out), daemon=True)
      thread.start()
      threads.append(thread)
    while True:
      codes = [p.poll() for p in procs]
      failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        rank, code = failed[0]
        out.write(f"[launch] rank {rank} exited with {code}; stopping the others\n")
        break
      if all(c == 0 for c in codes):
        break
      if deadline is not None and time.monotonic() > deadline:
        out.write(f"[launch] timeout after {timeout:g} s; stopping every rank\n")
        code = 124
        break
      time.sleep(0.1)
  except _Terminated:
    out.write("[launch] terminated; stopping every rank\n")
    code = None
  finally:
    if handler is not None:
      signal.signal(signal.SIGTERM, handler)
    _stop(procs)
    for thread in threads:
      thread.join(timeout=5)
  if code is None:  # the caller was asked to stop too
    raise SystemExit(128 + signal.SIGTERM)
  return code


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if "--" not in argv:
    print("usage: python -m spardl_jax.launch --processes N [--devices-per-process D] "
          "[--timeout S] -- COMMAND ...", file=sys.stderr)
    return 2
  split = argv.index("--")
  parser = argparse.ArgumentParser(prog="python -m spardl_jax.launch", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--processes", type=int, required=True)
  parser.add_argument("--devices-per-process", type=int, default=1)
  parser.add_argument("--timeout", type=float, default=None,
                      help="seconds for the whole job (positive and finite; default: none)")
  args = parser.parse_args(argv[:split])
  command = argv[split + 1:]
  if args.processes < 1 or args.devices_per_process < 1 or not command:
    parser.error("--processes and --devices-per-process must be >= 1, and a command is needed")
  if args.timeout is not None and not 0 < args.timeout < float("inf"):
    parser.error(f"--timeout must be a positive, finite number of seconds, got {args.timeout}")
  return launch(command, processes=args.processes,
                devices_per_process=args.devices_per_process, timeout=args.timeout)


if __name__ == "__main__":
  sys.exit(main())
