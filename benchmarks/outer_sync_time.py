"""Seconds per step of an outer loop's sync against per-step SparDL syncs
(benchmarks/results/outer.md): 4 simulated CPU devices, 4.35M parameters, a linear loss; 7
timed steps after one untimed.

python -m benchmarks.outer_sync_time [--n 4350000] [--steps 7]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import spardl_jax as sj
from benchmarks.cli import add_progress
from spardl_jax.tools.progress import bar


def loss(p, c):
  return jnp.sum(p["w"] * c[0])


RUNS = {
    "per-step 3% int4": optax.chain(sj.spardl(density=0.03, wire="int4"), optax.sgd(0.1)),
    "outer H=2 3% int4": sj.diloco(optax.sgd(0.1), sj.spardl(density=0.03, wire="int4"),
                                   every=2),
    "per-step 3% compact": optax.chain(sj.spardl(density=0.03, wire="compact"),
                                       optax.sgd(0.1)),
    "per-step 1% compact": optax.chain(sj.spardl(density=0.01, wire="compact"),
                                       optax.sgd(0.1)),
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.outer_sync_time",
                                   description=__doc__)
  parser.add_argument("--n", type=int, default=4_350_000)
  parser.add_argument("--steps", type=int, default=7)
  add_progress(parser)
  args = parser.parse_args(argv)
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  params = jax.device_put({"w": jnp.zeros((args.n,))}, NamedSharding(mesh, P()))
  batch = jax.device_put(np.random.default_rng(0).normal(size=(4, args.n)).astype(np.float32),
                         NamedSharding(mesh, P("data")))
  for name, tx in RUNS.items():
    state = sj.init_opt_state(tx, params, mesh)
    step = sj.data_parallel_step(loss, tx, mesh)
    p, state, _ = jax.block_until_ready(step(params, state, batch))
    seconds = []
    for _ in bar(range(args.steps), desc=name, enabled=not args.no_progress):
      start = time.perf_counter()
      p, state, _ = jax.block_until_ready(step(p, state, batch))
      seconds.append(round(time.perf_counter() - start, 3))
    print(name, seconds)
  return 0


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 4)  # simulated CPU devices, before any is used
  raise SystemExit(main())
