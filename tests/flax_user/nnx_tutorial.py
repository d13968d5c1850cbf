"""The Flax NNX MNIST tutorial's loop made data-parallel with the sync, on an 8-device data
mesh of each axis type: ``nnx.Optimizer`` and the whole loop under ``jax.set_mesh`` (the
metrics too), a train step that returns nothing (as the tutorial's) kept safe on simulated
devices by ``sj.bounded_dispatch``, ``metrics.reset()`` after each epoch, ``sj.sync_stats``
on the optimizer's state, and dropout drawing other masks on every device (a per-step key
folded with the device's index, ``nnx.reseed``). The loss must fall; the stats must be
arrays; the eight devices' masks must differ."""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spardl_jax as sj


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.l1 = nnx.Linear(16, 64, rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)
    self.l2 = nnx.Linear(64, 4, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(nnx.relu(self.l1(x))))


def run(kind):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
  rng = np.random.default_rng(0)
  w = rng.standard_normal((16, 4)).astype(np.float32)
  data = [rng.standard_normal((32, 16)).astype(np.float32) for _ in range(8)]
  batches = [tuple(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, x @ w))
             for x in data]
  with jax.set_mesh(mesh):  # the whole loop: NNX's metrics and optimizer live on this mesh
    model = MLP(nnx.Rngs(params=0, dropout=1))  # reseed reaches the named stream only
    optimizer = nnx.Optimizer(model, optax.chain(sj.spardl(density=0.1), optax.sgd(0.05)),
                              wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    opt_specs = nnx.StateSharding({sj.sync_state_filter(optimizer.opt_state): P("data"),
                                   ...: P()})

    @nnx.jit
    def train_step(model, optimizer, metrics, x, y, key):  # returns nothing
      @nnx.shard_map(mesh=mesh, in_specs=(P(), opt_specs, P("data"), P("data"), P()),
                     out_specs=P(), axis_names={"data"}, check_vma=False)
      def local(model, optimizer, x, y, key):
        nnx.reseed(model, dropout=jax.random.fold_in(key, jax.lax.axis_index("data")))
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return jax.lax.pmean(loss, "data")

      metrics.update(loss=local(model, optimizer, x, y, key))

    @nnx.jit
    def hidden(model, x, key):  # each device's dropout output, for the check below
      @nnx.shard_map(mesh=mesh, in_specs=(P(), P("data"), P()), out_specs=P("data"),
                     axis_names={"data"}, check_vma=False)
      def local(model, x, key):
        nnx.reseed(model, dropout=jax.random.fold_in(key, jax.lax.axis_index("data")))
        return model.drop(x)

      return local(model, x, key)

    step = sj.bounded_dispatch(train_step)
    key = jax.random.key(7)
    losses = []
    for epoch in range(4):
      for i, (x, y) in enumerate(batches):
        step(model, optimizer, metrics, x, y, jax.random.fold_in(key, epoch * 100 + i))
      losses.append(float(metrics.compute()["loss"]))
      metrics.reset()
    stats = sj.sync_stats(optimizer.opt_state)
    assert isinstance(stats.bytes_sent, jax.Array) and float(stats.bytes_sent.max()) > 0
    ones = jax.device_put(np.ones((8, 64), np.float32), NamedSharding(mesh, P("data")))
    masks = np.asarray(hidden(model, ones, key))
  assert losses[-1] < 0.5 * losses[0], losses
  assert len({tuple(row) for row in masks}) == 8, "every device draws its own mask"
  print(f"{kind.name}: loss by epoch {[round(v, 3) for v in losses]}, "
        f"{int(np.asarray(stats.selected)[0])} entries sent by device 0 in the last step")


for kind in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
  run(kind)
