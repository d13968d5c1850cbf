"""The NNX door: a Flax NNX data-parallel program in the shape of Flax's example (an MLP,
``nnx.Optimizer`` with AdamW, an ``@nnx.jit`` step, the batch sharded over a data mesh) made
SparDL's by its optimizer line and its step decorator; at density 1 it trains as the dense
program does, below 1 each step is the sync's NumPy model, and the metrics count every
device."""

import difflib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spardl_jax as sj
from tests import reference

# Flax's data-parallel example's shape, and the same program with SparDL: the lines that
# differ are the port.
DENSE = '''
mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8],
                     axis_types=(jax.sharding.AxisType.Auto,))
model = MLP(nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))

@nnx.jit
def train_step(model, optimizer, metrics, x, y):
  loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
  optimizer.update(model, grads)
  metrics.update(loss=loss)
  return loss

for x, y in batches:
  x, y = jax.device_put((x, y), NamedSharding(mesh, P("data")))
  loss = train_step(model, optimizer, metrics, x, y)
'''
SPARDL = DENSE.replace(
    "optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)",
    "optimizer = sj.nnx.Optimizer(model, optax.chain(sj.spardl(density=DENSITY, "
    "wire=\"exact\"),\n                             optax.adamw(1e-2)), mesh, wrt=nnx.Param)"
).replace("@nnx.jit", "@sj.nnx.data_parallel(mesh)")


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(16, 32, rngs=rngs)
    self.l2 = nnx.Linear(32, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.relu(self.l1(x)))


def batches(steps):
  rng = np.random.default_rng(0)
  w = rng.standard_normal((16, 4)).astype(np.float32)
  xs = [rng.standard_normal((64, 16)).astype(np.float32) for _ in range(steps)]
  return [(x, np.tanh(x @ w)) for x in xs]


def run(program, steps, density=1.0):
  scope = {"jax": jax, "jnp": jnp, "np": np, "optax": optax, "nnx": nnx, "sj": sj,
           "NamedSharding": NamedSharding, "P": P, "MLP": MLP, "DENSITY": density,
           "batches": batches(steps)}
  exec(program, scope)
  return scope


def test_the_port_is_two_lines_of_the_program():
  changed = [line for line in difflib.unified_diff(DENSE.splitlines(), SPARDL.splitlines(),
                                                    lineterm="", n=0)
             if line[:1] in "+-" and not line.startswith(("+++", "---"))]
  assert len(changed) <= 6, changed


def test_at_density_one_it_trains_as_the_dense_program():
  """Exact wire, density 1: the mean of the shards' gradients is the global batch's, so the
  losses follow the dense program's (within 1 % at the end) and the metric averages every
  device's loss."""
  dense, ours = run(DENSE, 60), run(SPARDL, 60)
  assert float(ours["loss"]) == pytest.approx(float(dense["loss"]), rel=0.01)
  assert float(ours["metrics"].compute()["loss"]) == pytest.approx(
      float(dense["metrics"].compute()["loss"]), rel=0.01)
  assert float(ours["loss"]) < 0.5 * float(run(SPARDL, 1)["loss"])


def test_below_density_one_each_step_is_the_syncs_numpy_model():
  """SparDL at 30 % with SGD after it, three steps: the parameters move by the learning rate
  times the NumPy model's SparDL of the eight devices' own gradients, its residuals fed
  back; every device's copy of the model is the same."""
  lr, steps = 0.1, 3
  mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
  model = MLP(nnx.Rngs(0))
  optimizer = sj.nnx.Optimizer(model, optax.chain(sj.spardl(density=0.3, wire="exact"),
                                                  optax.sgd(lr)), mesh, wrt=nnx.Param)

  @sj.nnx.data_parallel(mesh)
  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  graphdef, params = nnx.split(model, nnx.Param)
  flat, unravel = jax.flatten_util.ravel_pytree(jax.device_get(params))
  residuals = np.zeros((8, flat.size), np.float32)
  for x, y in batches(steps):
    def shard_grad(w, xs, ys):
      return jax.flatten_util.ravel_pytree(jax.grad(
          lambda p: jnp.mean((nnx.merge(graphdef, p)(xs) - ys) ** 2))(unravel(w)))[0]
    grads = np.stack([np.asarray(shard_grad(flat, x[8 * i:8 * i + 8], y[8 * i:8 * i + 8]))
                      for i in range(8)])
    mean, residuals = reference.spardl(grads, residuals, 0.3, wire="exact")
    flat = flat - lr * mean
    train_step(model, optimizer, x, y)
    got = jax.flatten_util.ravel_pytree(jax.device_get(nnx.state(model, nnx.Param)))[0]
    np.testing.assert_allclose(got, flat, rtol=1e-5, atol=1e-6)
  kernel = nnx.state(model, nnx.Param)["l1"]["kernel"][...]
  assert kernel.sharding.is_fully_replicated


def test_the_step_compiles_once(caplog):
  """A model and optimizer built off the mesh are put where the step leaves them before its
  first call, so the second call runs the first call's program (it compiled twice before,
  doubling an NNX program's wait)."""
  mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
  model = MLP(nnx.Rngs(0))
  optimizer = sj.nnx.Optimizer(model, optax.chain(sj.spardl(density=0.3), optax.sgd(0.1)),
                               mesh, wrt=nnx.Param)

  @sj.nnx.data_parallel(mesh)
  def counted_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  with jax.log_compiles(True), caplog.at_level("WARNING"):
    for x, y in batches(3):
      counted_step(model, optimizer, x, y)
  compiled = [r for r in caplog.records if "Finished XLA compilation" in r.getMessage()
              and "local" in r.getMessage()]
  assert len(compiled) == 1, [r.getMessage() for r in compiled]
