"""The rows of a global batch each process reads, and putting them on the mesh.

A data-parallel batch of ``B`` rows is split over the data axis; with several processes each
reads only the rows of its own devices (:func:`process_rows`) and places them with
:func:`shard_rows` (``local=True``), so no process ever holds the whole batch.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ['process_rows', 'shard_rows']


def process_rows(rows: int, mesh: jax.sharding.Mesh,
                 axis_name: str | tuple[str, ...] = "data") -> slice:
  """The rows of a ``(rows, ...)`` global batch that this process's devices hold.

  A multi-host input pipeline reads only these rows and passes them to :func:`shard_rows`
  with ``local=True``. ``axis_name`` is the axis the rows are split over, or a tuple of axes
  (an island axis, then the data axis inside it; the first the major one). Devices of one
  process must be contiguous along it (as in ``jax.make_mesh`` over ``jax.devices()``, which
  lists them process by process).
  """
  axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  size = math.prod(mesh.shape[a] for a in axes)
  if rows % size:
    raise ValueError(f"batch rows ({rows}) must be a multiple of the {axis_name!r} axis size "
                     f"({size}).")
  where = [mesh.axis_names.index(a) for a in axes]
  devices = np.moveaxis(mesh.devices, where, list(range(len(where)))).reshape(size, -1)
  mine = [i for i in range(size) if devices[i, 0].process_index == jax.process_index()]
  if not mine or mine != list(range(mine[0], mine[-1] + 1)):
    raise ValueError(f"process {jax.process_index()}'s devices are not contiguous along "
                     f"'{axis_name}' (positions {mine}); build the mesh from jax.devices().")
  per = rows // size
  return slice(mine[0] * per, (mine[-1] + 1) * per)


def shard_rows(tree, mesh: jax.sharding.Mesh, axis_name: str | tuple[str, ...] = "data", *,
               local: bool = False):
  """Puts host arrays on the mesh, split over ``axis_name`` along their first axis.

  Args:
    tree: arrays with a leading row axis.
    mesh: the mesh.
    axis_name: the axis the rows are split over (or a tuple of axes, the first the major).
    local: the arrays hold only this process's rows (:func:`process_rows`), as a multi-host
      pipeline reads them; otherwise every process passes the whole arrays and each supplies
      the rows of its own devices.

  The spec is full-rank (``P(axis, None, ...)``), the one jit gives its outputs, so feeding a
  returned state back does not recompile.
  """
  def put(a):
    a = np.asarray(a)
    sharding = NamedSharding(mesh, PartitionSpec(axis_name, *[None] * (a.ndim - 1)))
    if local:
      return jax.make_array_from_process_local_data(sharding, a)
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

  return jax.tree.map(put, tree)
