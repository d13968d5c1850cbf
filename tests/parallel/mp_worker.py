"""A rank of the multi-process tests, started by ``python -m spardl_jax.launch``.

``python tests/parallel/mp_worker.py MODE OUT``:

``MODE`` is one mode or several, comma-separated (run in order in the same job):

* ``allreduce``: one SparDL all-reduce (d = 1 and d = 2) and one TopkA all-reduce of fixed
  inputs over every device of the job; each rank saves the rows of its devices.
* ``train``: 2 epochs of the digits trainer with SparDL; rank 0 saves the parameters and
  every rank its devices' residual rows and the training examples it read.
* ``crash``: rank 1 dies after joining; the others wait in a collective.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # the repository

from spardl_jax import distributed  # noqa: E402

distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import spardl_jax as sj  # noqa: E402
from spardl_jax._src.parallel.rows import shard_rows  # noqa: E402

P_ALL = jax.device_count()
N = 3001
CASES = {"spardl": dict(density=0.05), "spardl_teams": dict(density=0.05, teams=2),
         "topka": dict(density=0.05)}


def inputs(p, n, seed=0):
  return np.random.default_rng(seed).standard_normal((p, n)).astype(np.float32)


def local_rows(x):
  """{global row: values} for the rows of this process's devices."""
  return {s.index[0].start: np.asarray(s.data)[0] for s in x.addressable_shards}


def recording(ds):
  """``ds`` whose training split logs the indices of every read, and that log."""
  import dataclasses

  from train.data import Split

  reads = []

  def take(idx):
    reads.append(np.array(idx))
    return ds.train.take(idx)

  return dataclasses.replace(ds, train=Split(ds.train.size, take)), reads


def main(modes, out):
  """Runs each of the comma-separated ``modes`` in one job (one start-up and one
  jax.distributed connection serve them all); each rank saves what its devices hold."""
  rank = jax.process_index()
  mesh = jax.make_mesh((P_ALL,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  saved = {}
  for mode in modes.split(","):
    saved.update(run(mode, rank, mesh))
  np.savez(os.path.join(out, f"rank{rank}.npz"), **saved)


def run(mode, rank, mesh):
  saved = {}
  if mode == "allreduce":
    xs = inputs(P_ALL, N)
    for name, options in CASES.items():
      method = sj.methods.make(name.split("_")[0], **options)
      state = shard_rows(sj.collectives.init_rows(method, P_ALL, N), mesh)
      ys, state = sj.collectives.sharded(method, mesh)(shard_rows(xs, mesh), state)
      for row, value in local_rows(ys).items():
        saved[f"{name}_y_{row}"] = value
      for row, value in local_rows(state.residual).items():
        saved[f"{name}_r_{row}"] = value
  elif mode == "train":
    from train import data
    from train.config import TrainConfig, Variant
    from train import make_mesh, train_and_evaluate
    cfg = TrainConfig(model="mlp", model_size="tiny", dataset="digits", devices=P_ALL,
                      epochs=2, batch_size=64)
    ds, reads = recording(data.load("digits"))
    result = train_and_evaluate(cfg, Variant("spardl", "spardl", {"density": 0.05}), ds,
                                make_mesh(P_ALL), progress=False)
    for row, value in local_rows(result.state.opt_state[0].method_state.residual).items():
      saved[f"r_{row}"] = value
    for i, leaf in enumerate(jax.tree.leaves(result.state.params)):
      saved[f"param_{i}"] = np.asarray(leaf.addressable_data(0))
    saved[f"reads_{rank}"] = np.stack(reads[1:])  # [0]: the example init reads
  elif mode == "crash":
    if rank == 1:
      os._exit(3)
    x = shard_rows(np.ones((P_ALL, 8), np.float32), mesh)
    f = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "data"), mesh=mesh,
                              in_specs=P("data"), out_specs=P("data")))
    while True:  # the peer is gone: gloo or the coordinator's heartbeat must end this
      jax.block_until_ready(f(x))
  return saved


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
