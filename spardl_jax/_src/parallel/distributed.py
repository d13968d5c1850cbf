"""Starting a multi-process (multi-host) job and topology-aware SparDL teams.

One process per host (or per GPU group) runs the same program; ``jax.distributed`` connects
them (NCCL carries collectives between GPUs, gloo between CPU processes), and a mesh over
``jax.devices()`` spans every process. :func:`initialize` reads the role of this process
from the environment that :mod:`spardl_jax._src.parallel.launch` sets (``SPARDL_COORDINATOR``,
``SPARDL_NUM_PROCESSES``, ``SPARDL_PROCESS_ID``, ``SPARDL_LOCAL_DEVICES``); without them it
defers to ``jax.distributed.initialize()``'s own cluster detection (SLURM, Open MPI, ...)
when ``auto=True``, and otherwise does nothing (a single-process run).
"""

from __future__ import annotations

import os

import jax

# The rows of a global batch each process reads, here with the rest of a multi-process job.
from spardl_jax._src.parallel.rows import process_rows, shard_rows

__all__ = ['environment', 'initialize', 'host_teams', 'process_rows', 'shard_rows']

_VARS = ("SPARDL_COORDINATOR", "SPARDL_NUM_PROCESSES", "SPARDL_PROCESS_ID",
         "SPARDL_LOCAL_DEVICES")


def environment(coordinator: str, num_processes: int, process_id: int,
                local_devices: int) -> dict[str, str]:
  """The environment variables that make a process rank ``process_id`` of a job."""
  return dict(zip(_VARS, (coordinator, str(num_processes), str(process_id),
                          str(local_devices))))


def initialize(*, auto: bool = False) -> bool:
  """Joins the ``jax.distributed`` job described by the environment, before JAX starts.

  Args:
    auto: without ``SPARDL_*`` variables, call ``jax.distributed.initialize()`` and let JAX
      detect the cluster (SLURM, Open MPI, Kubernetes ...).

  Returns:
    True when this process is part of a multi-process job.
  """
  if os.environ.get("SPARDL_COORDINATOR"):
    local = int(os.environ.get("SPARDL_LOCAL_DEVICES", "1"))
    jax.config.update("jax_num_cpu_devices", local)  # CPU only; GPUs use their own devices
    jax.distributed.initialize(os.environ["SPARDL_COORDINATOR"],
                               num_processes=int(os.environ["SPARDL_NUM_PROCESSES"]),
                               process_id=int(os.environ["SPARDL_PROCESS_ID"]))
    return True
  if auto:
    jax.distributed.initialize()
    return jax.process_count() > 1
  return False


def host_teams(devices=None) -> int:
  """SparDL's ``teams`` for one team per process (host): SRS over the fast local links of a
  host, Spar-All-Gather across hosts.

  Teams are contiguous ranks of the mesh axis, so build the mesh over ``devices`` in
  process order (``jax.devices()`` already is) and pass ``teams=host_teams()``: the ``Q``
  devices of one process then form one team. With one process this is 1.
  """
  devices = jax.devices() if devices is None else devices
  processes = sorted({d.process_index for d in devices})
  per = [sum(d.process_index == p for d in devices) for p in processes]
  if len(set(per)) != 1:
    raise ValueError(f"host_teams: processes hold different device counts {per}; teams "
                     f"must be equal.")
  order = [d.process_index for d in devices]
  if order != sorted(order):
    raise ValueError("host_teams: the devices are not in process order, so teams of "
                     "contiguous ranks would mix hosts; build the mesh over jax.devices().")
  return len(processes)
