"""The optax transformation: agreement with the core all-reduce, optax conformance, sharded
state, MultiSteps, statistics and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import spardl_jax as sj
from spardl_jax.collectives import Blocks
from spardl_jax.tools import traffic
from spardl_jax._src.core import schedule
from tests import harness, reference

AXIS = harness.AXIS


def params_tree():
  return {"a": jnp.zeros((5, 7), jnp.float32), "b": jnp.zeros((13,), jnp.bfloat16),
          "c": jnp.arange(3, dtype=jnp.int32)}


def local_grads(rng, p, params):
  """(P, ...) per-device gradients; integer leaves stay integer (they pass through)."""
  def one(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
      return jnp.asarray(rng.standard_normal((p, *x.shape)), x.dtype)
    return jnp.broadcast_to(x, (p, *x.shape))
  return jax.tree.map(one, params)


@pytest.mark.parametrize("p", [3, 4])
def test_matches_numpy_model_on_flattened_leaves(p):
  """Float leaves flattened in tree order (promoted to float32), reduced as one vector,
  cast back per leaf; integer leaves pass through."""
  params = params_tree()
  tx = sj.spardl(density=0.1)
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  grads = local_grads(np.random.default_rng(p), p, params)
  f = harness.update_fn(tx, p, params)
  # Float leaves in tree order, promoted to float32.
  flat = np.concatenate([np.asarray(grads["a"], np.float32).reshape(p, -1),
                         np.asarray(grads["b"], np.float32).reshape(p, -1)], axis=1)
  rs = np.zeros_like(flat)
  for _ in range(2):  # Same gradients twice: the second step adds the residuals.
    updates, state = f(harness.put_rows(p, grads), state)
    y, new_rs = reference.spardl(flat, rs, 0.1, wire="compact")  # the default format
    np.testing.assert_allclose(np.asarray(updates["a"]).reshape(-1), y[:35], rtol=1e-6,
                               atol=1e-7)
    np.testing.assert_allclose(np.asarray(updates["b"], np.float32),
                               y[35:].astype(jnp.bfloat16).astype(np.float32), rtol=1e-2)
    assert updates["b"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(updates["c"]), np.arange(3))  # passed through
    np.testing.assert_allclose(np.asarray(state.method_state.residual), new_rs, rtol=1e-6,
                               atol=1e-6)
    rs = new_rs


def test_density_one_is_pmean_and_stats():
  p = 4
  params = {"w": jnp.zeros((40, 30)), "v": jnp.zeros((17,))}
  tx = sj.spardl(density=1.0, wire="exact")  # exact: it must equal pmean
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  grads = local_grads(np.random.default_rng(0), p, params)
  updates, state = harness.update_fn(tx, p, params)(harness.put_rows(p, grads), state)
  for k in params:
    np.testing.assert_allclose(updates[k], np.asarray(grads[k]).mean(0), rtol=1e-5, atol=1e-6)
  stats = state.stats
  np.testing.assert_array_equal(stats.selected, 1217)
  np.testing.assert_allclose(stats.residual_norm, 0)


def test_stats_bytes_equal_the_compiled_traffic():
  p, n = 8, 20000
  params = {"w": jnp.zeros((n,))}
  tx = sj.spardl(density=0.01)
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  grads = local_grads(np.random.default_rng(1), p, params)
  f = harness.update_fn(tx, p, params)
  _, state = f(harness.put_rows(p, grads), state)
  hlo = traffic.parse_hlo(f.lower(harness.put_rows(p, grads), state).compile().as_text())
  np.testing.assert_array_equal(state.stats.bytes_sent, hlo.bytes_sent(0))
  kb = Blocks.make(n, p, 0.01).kb
  assert 0 < int(np.asarray(state.stats.selected)[0]) <= p * kb
  assert np.all(np.asarray(state.stats.residual_norm) > 0)


def test_state_structure_and_dtypes_are_stable_and_jit_does_not_recompile():
  """With a learning-rate schedule in the chain, as trainers use it."""
  p = 4
  params = {k: v for k, v in params_tree().items() if k != "c"}
  schedule = optax.linear_schedule(0.1, 0.01, transition_steps=10)
  tx = optax.chain(sj.spardl(density=0.05), optax.sgd(schedule, momentum=0.9))
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  f = harness.update_fn(tx, p, params)
  before = jax.tree.map(lambda a: (a.shape, a.dtype), state)
  rng = np.random.default_rng(0)
  for _ in range(3):
    _, state = f(harness.put_rows(p, local_grads(rng, p, params)), state)
  after = jax.tree.map(lambda a: (a.shape, a.dtype), state)
  assert jax.tree.structure(before) == jax.tree.structure(after)
  assert jax.tree.leaves(before) == jax.tree.leaves(after)
  assert f._cache_size() == 1


def test_multisteps_accumulates_locally_and_syncs_once():
  """MultiSteps around the sync: k micro-steps == one sync of the mean local gradient."""
  p, k = 4, 3
  params = {"w": jnp.zeros((64, 8)), "v": jnp.zeros((5,))}
  inner = optax.chain(sj.spardl(density=0.2), optax.sgd(1.0))
  multi = optax.MultiSteps(inner, every_k_schedule=k)
  mesh = harness.mesh(p)
  specs = sj.opt_state_specs(multi, params, mesh)
  assert jax.tree.leaves(specs.acc_grads) == [P(AXIS), P(AXIS)]
  state = sj.init_opt_state(multi, params, mesh)
  assert state.acc_grads["w"].shape == (p * 64, 8)
  rng = np.random.default_rng(5)
  micro = [local_grads(rng, p, params) for _ in range(k)]
  f = harness.update_fn(multi, p, params)
  for i, grads in enumerate(micro):
    updates, state = f(harness.put_rows(p, grads), state)
    if i < k - 1:
      assert not np.any(np.asarray(updates["w"]))
  mean = jax.tree.map(lambda *g: sum(g) / k, *micro)
  want, _ = harness.update_fn(inner, p, params)(harness.put_rows(p, mean),
                                                sj.init_opt_state(inner, params, mesh))
  for key in params:
    np.testing.assert_allclose(updates[key], want[key], rtol=1e-5, atol=1e-6)


def test_init_accepts_shape_dtype_structs():
  params = {"w": jax.ShapeDtypeStruct((10, 3), jnp.float32),
            "b": jax.ShapeDtypeStruct((3,), jnp.bfloat16)}
  state = jax.eval_shape(sj.spardl(density=0.1, axis_size=6).init, params)
  assert state.method_state.residual.shape == (6, 33)
  assert state.method_state.residual.dtype == jnp.float32
  assert state.stats.selected.shape == (6,)
  specs = sj.opt_state_specs(sj.spardl(density=0.1), params, harness.mesh(4))
  assert specs.method_state.residual == P(AXIS)
  with jax.set_mesh(harness.mesh(4)):
    state = jax.eval_shape(sj.spardl(density=0.1).init, params)
  assert state.method_state.residual.shape == (4, 33)


def test_dense_method_is_pmean():
  p = 3
  params = {"w": jnp.zeros((11, 2))}
  tx = sj.sync_gradients("dense")
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  grads = local_grads(np.random.default_rng(2), p, params)
  updates, state = harness.update_fn(tx, p, params)(harness.put_rows(p, grads), state)
  np.testing.assert_allclose(updates["w"], np.asarray(grads["w"]).mean(0), rtol=1e-6)
  assert float(np.asarray(state.stats.bytes_sent)[0]) == 2 * 2 * 22 * 4 // 3


def test_errors_are_clear():
  with pytest.raises(ValueError, match="axis_size"):
    sj.spardl(density=0.1).init({"w": jnp.zeros(3)})
  with pytest.raises(ValueError, match="method must be one of"):
    sj.sync_gradients("topk")
  with pytest.raises(ValueError, match="density"):
    sj.spardl(density=0.0)
  with pytest.raises(ValueError, match="residuals"):
    sj.spardl(residuals="some")
  with pytest.raises(ValueError, match="axis_size"):
    sj.spardl(axis_size=0)
  with pytest.raises(ValueError, match="no floating-point leaves"):
    sj.spardl(axis_size=2).init({"i": jnp.zeros(3, jnp.int32)})
  tx = sj.spardl(density=0.1, axis_size=2)
  state = tx.init({"w": jnp.zeros(3)})
  with pytest.raises(ValueError, match="inside jax.shard_map"):
    tx.update({"w": jnp.ones(3)}, state)
  mesh = jax.make_mesh((2,), ("batch",), devices=jax.devices()[:2])
  with pytest.raises(ValueError, match=r"init_opt_state: axis_name='data' is not an axis of "
                                       r"the mesh; its axes are \('batch',\)"):
    sj.init_opt_state(sj.spardl(density=0.1), {"w": jnp.zeros(3)}, mesh)
  with pytest.raises(ValueError, match=r"axis_name='data', but init runs inside jax.shard_map "
                                       r"over the axes \['batch'\]"):
    jax.shard_map(sj.spardl(density=0.1).init, mesh=mesh, in_specs=P(), out_specs=P(),
                  check_vma=False)({"w": jnp.zeros(3)})


# SparDL on one, an odd, a power-of-two and a 2^k * odd P (every P of tests/core/
# test_allreduce.py with SPARDL_JAX_FULL_TESTS=1), teams 1 to 4; each other method once.
NONFINITE_CASES = [("spardl", p, {"density": 0.1})
                   for p in harness.grid((1, 2, 3, 4, 5, 6, 7, 8, 12, 16), (1, 3, 8, 12))] + [
    ("spardl", 8, {"density": 0.1, "teams": 2}), ("spardl", 8, {"density": 0.1, "teams": 4}),
    ("spardl", 6, {"density": 0.1, "teams": 3}), ("dense", 4, {}), ("dense_bf16", 4, {}),
    ("topka", 4, {"density": 0.1}), ("topkdsa", 4, {"density": 0.1}),
    ("gtopk", 4, {"density": 0.1}), ("oktopk", 4, {"density": 0.1})]


@pytest.mark.parametrize("name,p,options", NONFINITE_CASES)
def test_a_nonfinite_step_is_skipped_on_every_device(name, p, options):
  """NaN on one device, then inf on another: every device decides the same, the update is
  zero, the method's state is bit-identical to the step before, and the next finite step
  is the one that would have followed without the bad steps."""
  params = {"w": jnp.zeros((6, 10)), "b": jnp.zeros((7,))}
  tx = sj.sync_gradients(name, **options)
  rng = np.random.default_rng(p)
  good = [local_grads(rng, p, params) for _ in range(2)]
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  f = harness.update_fn(tx, p, params).lower(harness.put_rows(p, good[0]), state).compile()
  updates, state = f(harness.put_rows(p, good[0]), state)
  before = state
  # Every method's reported bytes are what its compiled program sends, device by device.
  hlo = traffic.parse_hlo(f.as_text())
  if options.get("teams") == 3:  # B-SAG: the branch of the h this step used
    kb = Blocks.make(67, p // 3, options["density"]).kb
    hlo = hlo.branch(schedule.h_ladder(kb, 3).index(int(np.asarray(state.stats.h)[0])))
  if name != "dense":  # one XLA all-reduce: no permutes to count
    np.testing.assert_array_equal(np.asarray(state.stats.bytes_sent),
                                  [hlo.bytes_sent(d) for d in range(p)])
  assert np.count_nonzero(np.asarray(updates["w"])) > 0
  for device, value in ((p - 1, np.nan), (0, np.inf)):
    bad = jax.tree.map(np.array, good[1])
    bad["w"][device, 2, 3] = value
    updates, state = f(harness.put_rows(p, bad), state)
    for leaf in jax.tree.leaves(updates):
      np.testing.assert_array_equal(np.asarray(leaf), 0)
    for got, want in zip(jax.tree.leaves(state.method_state),
                         jax.tree.leaves(before.method_state)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(state.stats.nonfinite), [2] * p)
  updates, _ = f(harness.put_rows(p, good[1]), state)
  want, _ = f(harness.put_rows(p, good[1]), before)
  for got, expected in zip(jax.tree.leaves(updates), jax.tree.leaves(want)):
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_propagate_keeps_what_the_allreduce_computed():
  p = 4
  params = {"w": jnp.zeros((40,))}
  tx = sj.spardl(density=0.1, nonfinite="propagate")
  grads = local_grads(np.random.default_rng(0), p, params)
  grads = {"w": np.asarray(grads["w"]).copy()}
  grads["w"][1, 5] = np.nan
  updates, state = harness.update_fn(tx, p, params)(harness.put_rows(p, grads),
                                           sj.init_opt_state(tx, params, harness.mesh(p)))
  assert np.isnan(np.asarray(updates["w"])[5])
  np.testing.assert_array_equal(np.asarray(state.stats.nonfinite), [1] * p)


def test_apply_if_finite_around_the_sync_is_rejected():
  params = {"w": jnp.zeros((8,))}
  tx = optax.apply_if_finite(optax.chain(sj.spardl(density=0.5), optax.sgd(0.1)), 3)
  with pytest.raises(ValueError, match="apply_if_finite wraps a gradient sync.*"
                                       "nonfinite='skip'"):
    sj.init_opt_state(tx, params, harness.mesh(2))
  with pytest.raises(ValueError, match="nonfinite must be one of \\('skip', 'propagate'\\)"):
    sj.spardl(nonfinite="ignore")
  # After the sync, apply_if_finite sees the same synchronized gradient on every device.
  ok = optax.chain(sj.spardl(density=0.5), optax.apply_if_finite(optax.sgd(0.1), 3))
  sj.init_opt_state(ok, params, harness.mesh(2))
