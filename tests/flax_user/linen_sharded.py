"""A Linen model sharded over "model" as Flax's "Scale up on multiple devices" guide writes it
(``nn.with_partitioning`` kernels, an activation constraint), trained data-parallel with
``sj.data_parallel_step`` on a (data=4, model=2) mesh of each axis type: the first step
outside ``jax.set_mesh``, the rest inside. At density 1 on the exact wire it must equal dense
``jax.jit`` training of the same model; an activation constraint that names the data axis
is refused with the rule."""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spardl_jax as sj


class MLP(nn.Module):
  activations: P | None  # the constraint on the hidden activations, as the guide adds one
  rows: str | None  # how the second kernel's rows are sharded

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    h = nn.Dense(16, kernel_init=nn.with_partitioning(init, (None, "model")))(x)
    if self.activations is not None:
      h = jax.lax.with_sharding_constraint(h, self.activations)
    h = nn.relu(h)
    return nn.Dense(4, kernel_init=nn.with_partitioning(init, (self.rows, None)))(h)


def run(kind):
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind,) * 2)
  # On Auto axes the guide's tensor parallelism: the activations constrained over the mesh's
  # other axes only (the one-line rule), the second kernel sharded by rows. On Explicit axes
  # the activations' types carry their sharding, and JAX asks a product over two sharded
  # contracting dimensions for an out_sharding, which Linen's Dense cannot pass: its second
  # kernel is replicated.
  auto = kind == jax.sharding.AxisType.Auto
  model = MLP(P(None, "model"), "model") if auto else MLP(None, None)
  rng = np.random.default_rng(0)
  batches = [tuple(jax.device_put(rng.standard_normal(s).astype(np.float32),
                                  NamedSharding(mesh, P("data"))) for s in ((32, 8), (32, 4)))
             for _ in range(3)]
  # Initialized off the mesh (without the activations' constraint, which needs one), then
  # placed by the kernels' partitioning: the guide's jit(init, out_shardings=...) under the
  # mesh constrains the kernels inside init, which Explicit axes take as a failing assertion.
  boxed = model.clone(activations=None).init(jax.random.key(0), batches[0][0])
  params = jax.device_put(nn.meta.unbox(boxed), nn.get_sharding(boxed, mesh))["params"]

  def loss_fn(params, x, y, model=model):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

  @jax.jit
  def dense_step(params, x, y):
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss_fn)(params, x, y))

  want = params
  with jax.set_mesh(mesh):
    for x, y in batches:
      want = dense_step(want, x, y)

  tx = optax.chain(sj.spardl(density=1.0, wire="exact"), optax.sgd(0.1))
  opt_state = sj.init_opt_state(tx, params, mesh)
  step = sj.data_parallel_step(loss_fn, tx, mesh)
  got, opt_state, _ = step(params, opt_state, *batches[0])  # outside jax.set_mesh
  with jax.set_mesh(mesh):
    for x, y in batches[1:]:
      got, opt_state, loss = step(got, opt_state, x, y)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  assert jax.tree.leaves(got)[1].sharding.spec == P(None, "model")  # the layout is kept

  if auto:  # a constraint naming the data axis inside the step: refused with the rule
    wrong = MLP(P("data", "model"), "model")
    bad = sj.data_parallel_step(
        lambda p, x, y: jnp.mean((wrong.apply({"params": p}, x) - y) ** 2), tx, mesh)
    try:
      bad(got, opt_state, *batches[0])
    except ValueError as error:
      assert "name only the mesh's other axes there, e.g. P(None, 'model')" in str(error)
    else:
      raise AssertionError("a constraint over the data axis was accepted")
  print(f"{kind.name}: equals dense jit training, loss {float(loss):.4f}")


for kind in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
  run(kind)
