"""Flax users' paths with a sharded model: NNX (``nnx.Optimizer`` in ``nnx.jit`` and
``nnx.shard_map``; ``nnx.split``/``merge`` with :func:`spardl_jax.data_parallel_step`) and
Linen's ``TrainState.create``. The sync's
state must be built sharded, one row per device, never replicated; training at density 1
on the exact wire must equal dense ``jax.jit`` training of the same sharded model."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spardl_jax as sj

AUTO = (jax.sharding.AxisType.Auto,) * 2


def mesh():
  return jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8], axis_types=AUTO)


class MLP(nnx.Module):
  """Tensor-parallel over "model": the first kernel by columns, the second by rows."""

  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.l1 = nnx.Linear(16, 8, rngs=rngs,
                         kernel_init=nnx.with_partitioning(init, (None, "model")))
    self.l2 = nnx.Linear(8, 4, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("model", None)))

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


@nnx.jit
def create_model():
  model = MLP(nnx.Rngs(0))
  state = nnx.state(model)
  nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
  return model


def batches(m):
  rng = np.random.default_rng(0)
  return [tuple(jax.device_put(rng.standard_normal(s).astype(np.float32),
                               NamedSharding(m, P("data"))) for s in ((16, 16), (16, 4)))
          for _ in range(3)]


def test_nnx_optimizer_in_nnx_shard_map_keeps_its_state_sharded_and_equals_dense():
  """``nnx.Optimizer`` built under the mesh (the sync's rows sharded, one per device) and
  updated inside ``nnx.jit`` + a partial-auto ``nnx.shard_map`` over "data", as the API
  docs show it; at density 1 on the exact wire it trains like dense ``jax.jit``."""
  m = mesh()
  with jax.set_mesh(m):
    model = create_model()
    graphdef, params = nnx.split(model, nnx.Param)
    want = dense_training(graphdef, params, batches(m))
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))  # Auto axes: say the layout
    tx = optax.chain(sj.spardl(density=1.0, wire="exact", param_specs=specs), optax.sgd(0.1))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    residual = optimizer.opt_state[0].method_state.residual[...]
    # Local n: the kernels' halves (64 + 16) and half of the 12 replicated bias entries.
    assert residual.shape == (8, 86) and residual.sharding.spec == P(("data", "model"))
    opt_specs = nnx.StateSharding({sj.sync_state_filter(optimizer.opt_state): P("data"),
                                   ...: P()})

    @nnx.jit
    def train_step(model, optimizer, x, y):
      @nnx.shard_map(mesh=m, in_specs=(P(), opt_specs, P("data"), P("data")), out_specs=P(),
                     axis_names={"data"}, check_vma=False)
      def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda model: jnp.mean((model(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return jax.lax.pmean(loss, "data")
      return step(model, optimizer, x, y)

    for x, y in batches(m):
      train_step(model, optimizer, x, y)
  for got, ref in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)
  assert model.l1.kernel[...].sharding.spec == P(None, "model")
  assert optimizer.opt_state[0].method_state.residual[...].sharding.spec == P(("data", "model"))


def dense_training(graphdef, params, data):
  """The reference: plain jax.jit, the global batch's mean gradient, SGD."""
  @jax.jit
  def dense(params, x, y):
    grads = jax.grad(lambda p: jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2))(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  for x, y in data:
    params = dense(params, x, y)
  return params


def test_nnx_split_merge_with_data_parallel_step_equals_dense_jit_training():
  m = mesh()
  with jax.set_mesh(m):
    model = create_model()
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params, x, y):
      return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

    want = dense_training(graphdef, params, batches(m))
    tx = optax.chain(sj.spardl(density=1.0, wire="exact"), optax.sgd(0.1))
    opt_state = sj.init_opt_state(tx, params, m)
    step = sj.data_parallel_step(loss_fn, tx, m)
    for x, y in batches(m):
      params, opt_state, _ = step(params, opt_state, x, y)
    nnx.update(model, params)
  for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)
  assert model.l1.kernel[...].sharding.spec == P(None, "model")


def test_linen_train_state_create_under_the_mesh_and_data_parallel_step():
  m = mesh()
  specs = {"w": P(None, "model"), "b": P()}
  params = {"w": jax.device_put(jnp.full((16, 4), 0.1), NamedSharding(m, specs["w"])),
            "b": jax.device_put(jnp.zeros((4,)), NamedSharding(m, specs["b"]))}

  def apply_fn(variables, x):
    return x @ variables["params"]["w"] + variables["params"]["b"]

  def loss_fn(params, x, y):
    return jnp.mean((apply_fn({"params": params}, x) - y) ** 2)

  tx = optax.chain(sj.spardl(density=0.25), optax.sgd(0.1))
  with jax.set_mesh(m):
    state = train_state.TrainState.create(apply_fn=apply_fn, params=params, tx=tx)
    residual = state.opt_state[0].method_state.residual
    assert residual.shape == (8, 34) and residual.sharding.spec == P(("data", "model"))
    step = sj.data_parallel_step(loss_fn, tx, m)
    for x, y in batches(m):
      params, opt_state, loss = step(state.params, state.opt_state, x, y)
      state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  assert int(state.step) == 3 and np.isfinite(float(loss))
  assert state.params["w"].sharding.spec == P(None, "model")
  np.testing.assert_array_equal(np.asarray(sj.sync_stats(state.opt_state).nonfinite), 0)
