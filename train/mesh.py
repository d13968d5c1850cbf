"""The devices a run trains on: simulated CPU devices where asked, the mesh (one data axis, or
``--mesh`` axes with parameters sharded FSDP-style over ``model``) and the parameters' specs
on it."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import PartitionSpec

__all__ = ['MODEL_AXIS', 'ISLAND_AXIS', 'simulate_devices', 'make_mesh', 'param_specs',
           'batch_axes', 'replica_axis']


def simulate_devices(devices: int) -> None:
  """Asks for ``devices`` simulated CPU devices, if the backend has not started yet.

  Only the CPU backend reads the setting; once it has started (an embedding program, a
  test session) the call does nothing and :func:`make_mesh` checks what is there.
  """
  try:
    jax.config.update("jax_num_cpu_devices", max(devices, 1))
  except RuntimeError:
    pass


MODEL_AXIS = "model"  # the --mesh axis the trainer shards parameters over
ISLAND_AXIS = "island"  # the --islands axis: groups of devices joined by slow links


def make_mesh(devices: int | None = None, axis_name: str = "data", *,
              axes: tuple[tuple[str, int], ...] = (), islands: int = 1) -> jax.sharding.Mesh:
  """A 1-D mesh over the first ``devices`` devices of the default backend (all of them,
  across every process of a ``jax.distributed`` job, when None); or, with ``axes`` (``--mesh``
  pairs of axis and size, ``axis_name`` among them), a mesh of those axes over as many
  devices, its axes ``Auto`` so that the model code runs unchanged on sharded parameters; or,
  with ``islands`` M > 1, the mesh ``(island M, axis_name devices / M)``: M groups of devices,
  the process's devices in an island next to each other."""
  available = jax.devices()
  if islands > 1:
    if axes:
      raise ValueError("--islands and --mesh: give one (islands shard no parameters).")
    total = len(available) if devices is None else devices
    if total % islands or total > len(available):
      raise ValueError(f"--islands {islands} must divide the devices ({total}, of "
                       f"{len(available)} available on {available[0].platform}).")
    return jax.make_mesh((islands, total // islands), (ISLAND_AXIS, axis_name),
                         devices=available[:total],
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  if axes:
    names, sizes = zip(*axes)
    total = math.prod(sizes)
    if axis_name not in names:
      raise ValueError(f"--mesh must have the data axis {axis_name!r}, got axes {names}.")
    unknown = [n for n in names if n not in (axis_name, MODEL_AXIS)]
    if unknown:  # the trainer gives no other axis a meaning: it would shard as model does
      raise ValueError(f"--mesh knows the axes {axis_name!r} (the batch) and {MODEL_AXIS!r} "
                       f"(parameters sharded FSDP-style); got {unknown[0]!r}.")
    if devices is not None and devices != total:
      raise ValueError(f"--devices {devices} and --mesh ({total} devices) disagree; give one.")
    if total > len(available):
      raise ValueError(f"--mesh needs {total} devices, but {len(available)} are available "
                       f"on {available[0].platform}.")
    return jax.make_mesh(sizes, names, devices=available[:total],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(names))
  devices = len(available) if devices is None else devices
  if not 1 <= devices <= len(available):
    raise ValueError(f"--devices must be in [1, {len(available)}] (devices available on "
                     f"{available[0].platform}), got {devices}.")
  return jax.make_mesh((devices,), (axis_name,), devices=available[:devices],
                       axis_types=(jax.sharding.AxisType.Explicit,))


def batch_axes(mesh: jax.sharding.Mesh, axis_name: str) -> str | tuple[str, ...]:
  """The axes a batch is split over: ``axis_name``, or ``(island, axis_name)`` on an islands
  mesh (the island the major one)."""
  return (ISLAND_AXIS, axis_name) if ISLAND_AXIS in mesh.axis_names else axis_name


def replica_axis(mesh: jax.sharding.Mesh, axis_name: str) -> str:
  """The axis the optimizer state's rows are laid out over: the island axis on an islands
  mesh (an outer loop's replicas are the islands), else the data axis."""
  return ISLAND_AXIS if ISLAND_AXIS in mesh.axis_names else axis_name


def param_specs(params, mesh: jax.sharding.Mesh, axis_name: str):
  """FSDP-style ``PartitionSpec`` s of ``params`` over ``mesh``'s axes besides the data axis
  (and the island axis, over which the parameters are replicated): each parameter of at
  least 1,024 entries is sharded over all of them together along its largest dimension they
  divide; the rest (biases, norms) stay replicated. None where there is no such axis."""
  others = tuple(a for a in mesh.axis_names if a not in (axis_name, ISLAND_AXIS))
  if not others:
    return None
  size = math.prod(mesh.shape[a] for a in others)
  axis = others if len(others) > 1 else others[0]

  def spec(x):
    dims = [d for d in np.argsort(x.shape)[::-1] if x.shape[d] % size == 0]
    if x.size < 1024 or not dims:
      return PartitionSpec()
    return PartitionSpec(*(axis if d == dims[0] else None for d in range(len(x.shape))))

  return jax.tree.map(spec, params)
