"""A user's loop over 8 simulated CPU devices: SparDL inside shard_map, then AdamW.

``python tests/parallel/dispatch_loop.py MODE STEPS`` (tests/parallel/test_dispatch.py runs
it in its own process; docs/reliability.md has the measurements). ``free`` never waits for a
step, ``bounded`` wraps the step in spardl_jax.bounded_dispatch, ``each`` waits for every
step. It prints the steps and the seconds they took."""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

jax.config.update("jax_num_cpu_devices", 8)
import spardl_jax as sj  # noqa: E402

mode, steps = sys.argv[1], int(sys.argv[2])
mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
rng = np.random.default_rng(0)
params = jax.device_put(
    {"w1": jnp.asarray(rng.normal(size=(64, 256)) * 0.05, jnp.float32), "b1": jnp.zeros(256),
     "w2": jnp.asarray(rng.normal(size=(256, 10)) * 0.05, jnp.float32), "b2": jnp.zeros(10)},
    NamedSharding(mesh, P()))
tx = optax.chain(sj.spardl(density=0.01), optax.adamw(1e-3))
opt_state = sj.init_opt_state(tx, params, mesh)
specs = sj.opt_state_specs(tx, params, mesh)


def loss_fn(p, x, y):
  out = jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
  return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()


def step(p, s, x, y):
  g = jax.grad(loss_fn)(jax.lax.pcast(p, "data", to="varying"), x, y)
  u, s = tx.update(g, s, p)
  return optax.apply_updates(p, u), s, jax.lax.pmean(loss_fn(p, x, y), "data")


train_step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                                   out_specs=(P(), specs, P()), check_vma=False))
if mode == "bounded":
  train_step = sj.bounded_dispatch(train_step)
rows = NamedSharding(mesh, P("data"))
x = jax.device_put(jnp.asarray(rng.normal(size=(256, 64)), jnp.float32), rows)
y = jax.device_put(jnp.asarray(rng.integers(0, 10, 256)), rows)
params, opt_state, loss = jax.block_until_ready(train_step(params, opt_state, x, y))  # compile
start, losses = time.perf_counter(), []
for _ in range(steps):
  params, opt_state, loss = train_step(params, opt_state, x, y)
  if mode == "each":
    jax.block_until_ready(loss)
  losses.append(loss)
print("finished", steps, f"{float(losses[-1]):.4f}", f"{time.perf_counter() - start:.2f} s",
      flush=True)
