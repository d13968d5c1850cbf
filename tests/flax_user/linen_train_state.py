"""Linen's ``TrainState.create`` under ``jax.set_mesh``, as Flax's examples build their state,
with the sync inside the optimizer and with the sync inside an outer loop (``sj.diloco``), on
an 8-device data mesh of each axis type. The state must come out laid out for the step (the
outer loop's per-replica offsets over the data axis); at density 1 on the exact wire, with
one inner step per round and an outer step of 1, both must equal dense ``jax.jit`` SGD."""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spardl_jax as sj

LR = 0.1


def run(kind):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
  model = nn.Sequential([nn.Dense(16), nn.tanh, nn.Dense(4)])
  rng = np.random.default_rng(1)
  batches = [tuple(jax.device_put(rng.standard_normal(s).astype(np.float32),
                                  NamedSharding(mesh, P("data"))) for s in ((32, 8), (32, 4)))
             for _ in range(3)]

  def loss_fn(params, x, y):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

  @jax.jit
  def dense_step(params, x, y):
    return jax.tree.map(lambda p, g: p - LR * g, params, jax.grad(loss_fn)(params, x, y))

  exact = sj.spardl(density=1.0, wire="exact")
  methods = {"chain": optax.chain(exact, optax.sgd(LR)),
             "diloco": sj.diloco(optax.sgd(LR), exact, every=1, outer=optax.sgd(1.0))}
  for name, tx in methods.items():
    with jax.set_mesh(mesh):
      params = model.init(jax.random.key(0), batches[0][0])["params"]
      state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
      want = params
      for x, y in batches:
        want = dense_step(want, x, y)
      if name == "diloco" and kind == jax.sharding.AxisType.Explicit:
        offsets = jax.tree.leaves(state.opt_state.offset)
        assert all(o.shape[0] == 8 and o.sharding.spec[0] == "data" for o in offsets)
      step = sj.data_parallel_step(loss_fn, tx, mesh)
      for x, y in batches:
        new_params, new_opt_state, loss = step(state.params, state.opt_state, x, y)
        state = state.replace(step=state.step + 1, params=new_params, opt_state=new_opt_state)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    print(f"{kind.name} {name}: equals dense jit SGD, loss {float(loss):.4f}")


for kind in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
  run(kind)
