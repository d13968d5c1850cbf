"""Seconds per step of an outer loop's sync against per-step SparDL syncs (docs/outer.md):
4 simulated CPU devices, 4.35M parameters, a linear loss; 7 timed steps after one untimed."""

import os
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402  (after the flag that makes the devices)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import spardl_jax as sj  # noqa: E402

N = 4_350_000
mesh = jax.make_mesh((4,), ("data",))
params = jax.device_put({"w": jnp.zeros((N,))}, NamedSharding(mesh, P()))
batch = jax.device_put(np.random.default_rng(0).normal(size=(4, N)).astype(np.float32),
                       NamedSharding(mesh, P("data")))


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
for name, tx in RUNS.items():
  state = sj.init_opt_state(tx, params, mesh)
  step = sj.data_parallel_step(loss, tx, mesh)
  p, state, _ = jax.block_until_ready(step(params, state, batch))
  seconds = []
  for _ in range(7):
    start = time.perf_counter()
    p, state, _ = jax.block_until_ready(step(p, state, batch))
    seconds.append(round(time.perf_counter() - start, 3))
  print(name, seconds)
