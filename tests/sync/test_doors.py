"""Every door checks its input before any work (issue 47): synced_adamw and
scale_by_synced_adam, param_specs through use_param_specs and tx.update, a sync that sees only
part of the parameters, several syncs read by sync_stats, a state from another optimizer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import spardl_jax as sj
from tests import harness


@pytest.mark.parametrize("kwargs, match", [
    (dict(learning_rate=float("nan")), "learning_rate must be a finite number >= 0 or an "
                                       "optax schedule, got nan"),
    (dict(learning_rate=float("inf")), "learning_rate must be .*, got inf"),
    (dict(learning_rate=None), "learning_rate must be .*, got None"),
    (dict(learning_rate=-1e-3), "learning_rate must be .*, got -0.001"),
    (dict(learning_rate="1e-3"), "learning_rate must be .*, got '1e-3'"),
    (dict(weight_decay=float("nan")), "weight_decay must be a finite number >= 0, got nan"),
    (dict(weight_decay=-0.1), "weight_decay must be a finite number >= 0, got -0.1"),
    (dict(momentum=0.9), r"momentum=0.9 \(DGC's momentum correction\) would put a second "),
])
def test_synced_adamw_checks_its_options(kwargs, match):
  args = {"learning_rate": 1e-3, "warmup_steps": 10, **kwargs}
  with pytest.raises(ValueError, match=match):
    sj.synced_adamw(args.pop("learning_rate"), **args)


def test_synced_adamw_takes_a_schedule():
  """The schedule is read at each step: one that is 0 at step 0 and 1e-2 after leaves the
  parameters where they are at the first step and moves them at the second."""
  mesh = harness.mesh(8)
  x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
  params = {"w": jnp.zeros((4, 2))}  # a matrix: the sync's (1-D leaves go dense)

  def loss_fn(params, x):
    return jnp.mean((x @ params["w"] - x[:, :2]) ** 2)

  tx = sj.synced_adamw(lambda count: jnp.where(count < 1, 0.0, 1e-2), warmup_steps=10)
  state = sj.init_opt_state(tx, params, mesh)
  step = sj.data_parallel_step(loss_fn, tx, mesh)
  first, state, _ = step(params, state, x)
  second, _, _ = step(first, state, x)
  np.testing.assert_array_equal(first["w"], np.zeros((4, 2)))
  assert np.all(np.asarray(second["w"]) != 0)


@pytest.mark.parametrize("sync, match", [
    (sj.spardl(density=0.01, warmup_steps=5), "freeze_step=10, but the sync's dense warm-up "
                                              "is 5 steps.* or lower freeze_step to 5"),
    (sj.spardl(density=0.01), "the sync's dense warm-up is 0 steps.*warmup_steps=10 "
                              r"\(or more\)\.$"),
])
def test_scale_by_synced_adam_needs_the_syncs_warmup(sync, match):
  with pytest.raises(ValueError, match=match):
    sj.adam.scale_by_synced_adam(sync, freeze_step=10)
  sj.adam.scale_by_synced_adam(sj.sync_gradients("dense"), freeze_step=10)  # always the mean


def test_a_state_of_another_optimizer_is_named():
  params = {"w": jnp.zeros((10,))}
  tx = sj.synced_adamw(1e-3, warmup_steps=2)
  other = sj.init_opt_state(optax.chain(sj.spardl(), optax.adamw(1e-3)), params,
                            harness.mesh(4))
  with pytest.raises(TypeError, match="state must be what this transformation's init returns"
                                      ".*got tuple of SyncState, tuple"):
    tx.update(params, other, params)


MESH_AXES = (4, 2)


def _auto_mesh():
  return jax.make_mesh(MESH_AXES, ("data", "model"), devices=jax.devices()[:8],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.mark.parametrize("specs, match", [
    ({"w": "model", "b": None}, r"param_specs must hold a PartitionSpec .* got 'model' at "
                                r"\['w'\]; write PartitionSpec\('model'\)"),
    ({"w": P(None, "nosuch"), "b": P()}, r"names the axis 'nosuch' at \['w'\], which is not "
                                         r"in the mesh \('data', 'model'\)"),
    ({"w": P("data"), "b": P()}, r"parameter \['w'\] is sharded over the data axis 'data'"),
])
def test_param_specs_through_use_param_specs_are_checked(specs, match):
  mesh = _auto_mesh()
  params = {"w": jnp.zeros((8, 4)), "b": jnp.zeros(6)}
  init = jax.shard_map(sj.spardl(density=0.1).init, mesh=mesh,
                       in_specs=({"w": P(None, "model"), "b": P()},),
                       out_specs=P(("data", "model")), check_vma=False)
  with pytest.raises(ValueError, match=match):
    with sj.use_param_specs(specs):
      jax.eval_shape(init, params)


def test_param_specs_through_update_are_checked():
  mesh = harness.mesh(4)
  params = {"w": jnp.zeros((8, 4))}
  tx = sj.spardl(density=0.1)
  state = sj.init_opt_state(tx, params, mesh)
  specs = sj.opt_state_specs(tx, params, mesh)
  step = jax.shard_map(lambda g, s: tx.update(g, s, param_specs={"w": P("data")}), mesh=mesh,
                       in_specs=(P(), specs), out_specs=(P(), specs), check_vma=False)
  with pytest.raises(ValueError, match=r"tx.update's param_specs.*sharded over the data axis"):
    jax.eval_shape(step, params, state)


@pytest.mark.parametrize("make", [
    lambda: optax.masked(sj.spardl(density=0.1), {"w": True, "b": False}),
    lambda: optax.multi_transform({"m": sj.spardl(density=0.1), "v": optax.identity()},
                                  {"w": "m", "b": "v"}),
])
def test_a_sync_that_sees_part_of_the_parameters_is_refused(make):
  """The leaves it does not see would be applied with each device's own gradient."""
  params = {"w": jnp.zeros((16, 8)), "b": jnp.zeros(8)}
  tx = optax.chain(make(), optax.sgd(0.1))
  with pytest.raises(ValueError, match="syncs see 1 of the 2 float parameter leaves.*"
                                       "dense_leaves='vectors'"):
    sj.init_opt_state(tx, params, harness.mesh(4))


def test_a_sync_per_part_works_and_sync_stats_reads_each():
  """A sparse sync on the matrices, a dense one on the biases: every leaf is the mean's
  (density 1 here), and sync_stats names both parts."""
  p = 4
  params = {"w": jnp.zeros((16, 8)), "b": jnp.zeros(8)}
  tx = optax.multi_transform({"m": sj.spardl(density=1.0, wire="exact"),
                              "v": sj.sync_gradients("dense")}, {"w": "m", "b": "v"})
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  rng = np.random.default_rng(0)
  grads = {k: rng.standard_normal((p, *v.shape)).astype(np.float32) for k, v in params.items()}
  updates, state = harness.update_fn(tx, p, params)(harness.put_rows(p, grads), state)
  for k in params:
    np.testing.assert_allclose(updates[k], grads[k].mean(0), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match=r"found 2 \(at .*'m'.*'v'.*by_part=True"):
    sj.sync_stats(state)
  parts = sj.sync_stats(state, by_part=True)
  assert len(parts) == 2 and all(np.all(s.bytes_sent > 0) for s in parts.values())


def _dp_setup():
  mesh = harness.mesh(8)
  tx = optax.chain(sj.spardl(density=0.5), optax.sgd(0.1))
  params = {"w": jnp.zeros((4,))}
  return mesh, tx, params, sj.init_opt_state(tx, params, mesh)


def test_data_parallel_step_reduces_aux_by_kind():
  """Per-example leaves come back in batch order, counts summed, float leaves averaged; a
  batch given replicated is split over the data axis."""
  mesh, tx, params, state = _dp_setup()
  x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32)

  def loss_fn(p, x):
    pred = x @ p["w"] + jnp.arange(x.shape[0]) + 10 * jax.lax.axis_index("data")
    return jnp.mean((pred - 1) ** 2), {"n": jnp.sum(pred >= 0), "pred": pred,
                                       "m": jnp.mean(pred)}

  _, _, loss, aux = sj.data_parallel_step(loss_fn, tx, mesh, has_aux=True)(params, state, x)
  expected = np.concatenate([np.arange(2) + 10 * d for d in range(8)])  # 2 rows a device
  np.testing.assert_array_equal(aux["pred"], expected)
  assert int(aux["n"]) == 16
  np.testing.assert_allclose(float(aux["m"]), expected.mean(), rtol=1e-6)
  np.testing.assert_allclose(float(loss), np.mean((expected - 1.0) ** 2), rtol=1e-6)


@pytest.mark.parametrize("loss_fn, has_aux, match", [
    (lambda p, x: (jnp.mean(x @ p["w"]), "hi"), True,
     "aux is a str; aux leaves must be arrays or numbers"),
    (lambda p, x: jnp.mean(x @ p["w"]), True, r"has_aux=True, so loss_fn must return "
                                              r"\(loss, aux\), got one value"),
    (lambda p, x: (x @ p["w"]) ** 2, False, r"must return a float scalar.*got float32\[2\]; "
                                            r"take the mean over the examples"),
    (lambda p, x: jnp.sum(x @ p["w"]).astype(jnp.int32), False, "float scalar.*got int32"),
    (lambda p, x: (jnp.mean(x @ p["w"]), 1), False, "returned a tuple;.*pass has_aux=True"),
])
def test_data_parallel_step_names_loss_and_aux_mistakes(loss_fn, has_aux, match):
  mesh, tx, params, state = _dp_setup()
  step = sj.data_parallel_step(loss_fn, tx, mesh, has_aux=has_aux)
  with pytest.raises(TypeError, match=match):
    step(params, state, jnp.ones((16, 4)))


def test_data_parallel_step_names_a_batch_the_devices_do_not_divide():
  mesh, tx, params, state = _dp_setup()
  step = sj.data_parallel_step(lambda p, x: jnp.mean(x @ p["w"]), tx, mesh)
  with pytest.raises(ValueError, match=r"batch\[0\] has shape \(12, 4\).*multiple of 8"):
    step(params, state, jnp.ones((12, 4)))
