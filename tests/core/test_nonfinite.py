"""The raw all-reduces cannot be poisoned: a NaN or inf on one device (or on a thousand
entries) is skipped by every device alike, and the books stay finite; and a finite value at
float32's maximum is never turned into inf by the compact wire."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spardl_jax as sj
from spardl_jax.collectives import SparDLConfig, sharded_allreduce
from tests import harness

P_ = 4
N = 1000


def _bad(rng, count, value):
  xs = harness.gradients(rng, P_, N)
  xs[1, rng.choice(N, count, replace=False)] = value
  return xs


@pytest.mark.parametrize("count,value", [(1, np.nan), (1000, np.nan), (3, -np.inf)])
def test_spardl_allreduce_skips_a_nonfinite_call_and_nothing_is_poisoned(count, value):
  """A bad call returns zeros and the state it was given, on every device; the next good
  call is bit-identical to the one that would have followed without the bad one."""
  rng = np.random.default_rng(count)
  config = SparDLConfig(density=0.05)
  good = [harness.gradients(rng, P_, N) for _ in range(3)]
  _, state = harness.run_state(good[0], harness.rows(P_, N, config), config)
  before = np.asarray(state.residual)
  ys, state = harness.run_state(_bad(rng, count, value), state, config)
  np.testing.assert_array_equal(ys, 0)
  np.testing.assert_array_equal(np.asarray(state.residual), before)
  for xs in good[1:]:  # before this guard every later call stayed NaN
    ys, state = harness.run_state(xs, state, config)
    assert np.isfinite(ys).all() and np.isfinite(np.asarray(state.residual)).all()


def test_the_skip_is_the_same_as_never_seeing_the_bad_call():
  rng = np.random.default_rng(7)
  config = SparDLConfig(density=0.05)
  xs = [harness.gradients(rng, P_, N) for _ in range(2)]
  _, state = harness.run_state(xs[0], harness.rows(P_, N, config), config)
  clean, clean_state = harness.run_state(xs[1], state, config)
  _, skipped = harness.run_state(_bad(rng, 1, np.nan), state, config)
  after, after_state = harness.run_state(xs[1], skipped, config)
  np.testing.assert_array_equal(after, clean)
  np.testing.assert_array_equal(np.asarray(after_state.residual),
                                np.asarray(clean_state.residual))


@pytest.mark.parametrize("name", sj.methods.names())
def test_every_method_in_sharded_skips_alike(name):
  """methods.sharded applies the same agreed policy to every registered method."""
  options = {"density": 0.1} if name not in ("dense", "dense_bf16", "powersgd") else {}
  method = sj.methods.make(name, **options)
  if hasattr(method, "for_leaves"):
    method = method.for_leaves([(N,)])
  rng = np.random.default_rng(1)
  state = harness.method_rows(P_, N, method)
  exe = harness.method_executable(P_, N, method)
  _, state = exe(harness.put(P_, harness.gradients(rng, P_, N)), state)
  before = [np.asarray(leaf) for leaf in jax.tree.leaves(state)]
  ys, state = exe(harness.put(P_, _bad(rng, 1, np.nan)), state)
  np.testing.assert_array_equal(np.asarray(ys), 0)
  for got, want in zip(jax.tree.leaves(state), before):
    np.testing.assert_array_equal(np.asarray(got), want)


def test_propagate_returns_what_was_computed():
  config = SparDLConfig(density=0.05)
  f = sharded_allreduce(config, harness.mesh(P_), harness.AXIS, nonfinite="propagate")
  ys, state = f(harness.put(P_, _bad(np.random.default_rng(2), 1, np.nan)),
                harness.rows(P_, N, config))
  assert np.isnan(np.asarray(ys)).any()


def test_compact_wire_keeps_float32_max_finite_and_conserved():
  """bfloat16's round to nearest makes 3.4028e38 inf; the compact wire sends bfloat16's
  largest finite value instead and keeps the difference in the sender's residual."""
  config = SparDLConfig(density=0.05)
  xs = np.zeros((P_, N), np.float32)
  xs[2, 5] = np.finfo(np.float32).max
  xs[0, 9] = -np.finfo(np.float32).max
  ys, state = harness.run_state(xs, harness.rows(P_, N, config), config)
  rs = np.asarray(state.residual)
  assert np.isfinite(ys).all() and np.isfinite(rs).all()
  assert ys[0, 5] > 0 and ys[0, 9] < 0
  harness.assert_conserved(xs, np.zeros_like(xs, np.float64), ys, rs)
  # Through the optax sync: a finite gradient, so the step is not counted non-finite.
  params = {"w": jnp.zeros((N,))}
  tx = optax.chain(sj.spardl(density=0.05), optax.sgd(1e-40))
  updates, opt_state = harness.update_fn(tx, P_, params)(
      harness.put_rows(P_, {"w": xs}), sj.init_opt_state(tx, params, harness.mesh(P_)))
  assert np.isfinite(np.asarray(updates["w"])).all()
  np.testing.assert_array_equal(np.asarray(sj.sync_stats(opt_state).nonfinite), 0)


@pytest.mark.parametrize("wire", ["exact", "compact", "int8", "int4", "int2"])
def test_every_wire_carries_float32s_largest_values_step_after_step(wire):
  """One device's entry at float32's maximum (and another at 3e38, both signs), five syncs
  in a row: no wire rounds a finite value into inf (the quantized formats' largest scale
  keeps qmax 2^e finite), and the rounding error kept in the residual plus the same value
  again is held at the largest finite value with the rest kept: every result and residual
  finite, no step skipped, and, until a backlog itself outgrows float32 (int2 delivers at
  most 2^127 a step), the mass conserved as on the exact wire."""
  config = SparDLConfig(density=0.05, wire=wire)
  big = np.finfo(np.float32).max
  xs = harness.gradients(np.random.default_rng(5), P_, N)
  xs[2, 5], xs[0, 9], xs[3, 11] = big, -big, 3e38
  state = harness.rows(P_, N, config)
  residuals = np.zeros((P_, N), np.float64)
  for step in range(5):
    ys, state = harness.run_state(xs, state, config)
    rs = np.asarray(state.residual)
    assert np.isfinite(ys).all() and np.isfinite(rs).all(), (wire, step)
    assert ys[0, 5] > 0 and ys[0, 9] < 0 and ys[0, 11] > 0, (wire, step)  # not skipped
    if wire != "int2" or step == 0:
      total_in = (xs.astype(np.float64) + residuals).sum(0)
      total_out = rs.astype(np.float64).sum(0) + P_ * ys[0].astype(np.float64)
      np.testing.assert_allclose(total_out, total_in, rtol=1e-6, atol=1e-3)
    residuals = rs.astype(np.float64)
