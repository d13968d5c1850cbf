"""Adding a state type is one file: a transformation defined in this module, whose state
declares its layout once, is laid out, initialized sharded, trained and folded by the library
with nothing else changed (as ``test_new_method.py`` shows for a method)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spardl_jax as sj
from spardl_jax._src.core import protocol
from spardl_jax._src.core.protocol import LIKE_PARAMS, PER_DEVICE, REPLICATED, SUM, Field


@protocol.layout(steps=Field(REPLICATED), local_sq=Field(PER_DEVICE, SUM))
class LocalNormState(NamedTuple):
  """``steps`` (replicated), each device's running sum of its own squared gradient norm
  (per device: it differs between devices), and a decayed gradient shaped like the
  parameters (no declaration: laid out as they are)."""

  steps: jax.Array
  local_sq: jax.Array
  trace: optax.Updates


def track_local_norm(decay: float = 0.5) -> optax.GradientTransformation:
  """Passes the gradient through, keeping per device the sum of its squared norms."""
  def init_fn(params):
    return LocalNormState(jnp.zeros((), jnp.int32), jnp.zeros((1,), jnp.float32),
                          jax.tree.map(jnp.zeros_like, params))

  def update_fn(updates, state, params=None):
    del params
    sq = sum(jnp.sum(g.astype(jnp.float32) ** 2) for g in jax.tree.leaves(updates))
    trace = jax.tree.map(lambda t, g: decay * t + g, state.trace, updates)
    return updates, LocalNormState(state.steps + 1, state.local_sq + sq, trace)

  return optax.GradientTransformation(init_fn, update_fn)


def sharded_params():
  """A (data 4, model 2) mesh and parameters on it, ``w`` sharded over ``model``."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8],
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  specs = {"b": P(), "w": P(None, "model")}
  params = {k: jax.device_put(jnp.zeros(shape), NamedSharding(mesh, specs[k]))
            for k, shape in (("b", (4,)), ("w", (6, 4)))}
  return mesh, specs, params


def test_a_new_state_type_needs_no_edit_elsewhere():
  mesh, specs, params = sharded_params()
  tx = optax.chain(track_local_norm(), sj.spardl(density=1.0, wire="exact"), optax.sgd(0.1))

  state_specs = sj.opt_state_specs(tx, params, mesh)
  ours = state_specs[0]
  assert ours == LocalNormState(P(), P(("data", "model")), specs)
  assert sj.checkpoint.fold_rules(sj.init_opt_state(tx, params, mesh))[0] == LocalNormState(
      protocol.FRESH, SUM, {"b": protocol.FRESH, "w": protocol.FRESH})

  state = sj.init_opt_state(tx, params, mesh)
  assert state[0].local_sq.shape == (8,)  # a row per device of the mesh
  assert state[0].trace["w"].sharding.spec == P(None, "model")

  # Each data shard a gradient of its own: every device's running sum is its own.
  step = sj.data_parallel_step(lambda p, x: jnp.sum(p["w"] * x) + jnp.sum(p["b"]) * x.mean(),
                               tx, mesh)  # a data shard x is (6, 4), like w
  rng = np.random.default_rng(0)
  xs = rng.standard_normal((4, 6, 4)).astype(np.float32)
  batch = jax.device_put(xs.reshape(24, 4), NamedSharding(mesh, P("data")))
  for _ in range(2):
    params, state, _ = step(params, state, batch)
  # On data shard i the gradient is x_i for w and mean(x_i) for each entry of b. The step's
  # shard_map is over "data" only, so each device sees whole leaves, and both devices of a
  # data shard (its two model columns) keep the same sum.
  per_shard = 2 * ((xs ** 2).sum(axis=(1, 2)) + 4 * xs.mean(axis=(1, 2)) ** 2)
  expected = np.repeat(per_shard, 2)  # rows data-major: (data 0, model 0), (0, 1), ...
  np.testing.assert_allclose(np.asarray(state[0].local_sq), expected, rtol=1e-5)
  assert int(state[0].steps) == 2
  assert params["w"].sharding.spec == P(None, "model")  # Explicit axes: kept by its type


@protocol.layout(moment=Field(LIKE_PARAMS))
class DeclaredLikeParams(NamedTuple):
  """A field declared to lie like the parameters."""

  moment: optax.Updates


def test_a_field_declared_like_the_parameters_follows_them_or_is_refused():
  mesh, specs, params = sharded_params()
  like = optax.GradientTransformation(
      lambda p: DeclaredLikeParams(jax.tree.map(jnp.zeros_like, p)), None)
  got = sj.opt_state_specs(like, params, mesh)
  assert got.moment == specs
  wrong = optax.GradientTransformation(lambda p: DeclaredLikeParams(jnp.zeros(3)), None)
  with pytest.raises(ValueError, match="declared like the parameters .* not the parameters' "
                                       "local shapes"):
    sj.opt_state_specs(wrong, params, mesh)
