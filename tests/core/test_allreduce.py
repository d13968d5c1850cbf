"""SparDL all-reduce (d = 1) in the exact wire format against the NumPy model, pmean, and its
invariants (the compact format, the default, is tested the same way in test_wire.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from spardl_jax.collectives import SparDLConfig, SparDLState, spardl_allreduce
from tests import formulas, harness, reference

WORKERS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]  # every traffic case of the cost table's d = 1 row
DENSITIES = [1.0, 0.3, 0.01]
# Every P at 1 % (every traffic case); 30 % and density 1 (every block whole) at P of each
# kind: a power of two, an odd P, a P = 2^k * odd.
CASES = harness.grid([(p, d) for p in WORKERS for d in DENSITIES],
                     [(p, 0.01) for p in WORKERS] + [(3, 0.3), (8, 0.3), (12, 0.3),
                                                     (2, 1.0), (5, 1.0), (12, 1.0)])


@pytest.mark.parametrize("p,density", CASES)
def test_matches_numpy_model_and_the_cost_table(p, density):
  """Three iterations fed back, against the NumPy model: bit-identical on every device,
  conserving mass; and the compiled program's traffic is the cost table's (one
  compilation serves both)."""
  n = 1237 if p != 4 else 5003  # not divisible by p; 5003 also exercises two-stage top-k
  config = SparDLConfig(wire="exact", density=density)
  rng = np.random.default_rng(p * 100 + int(density * 100))
  rs = np.zeros((p, n), np.float32)
  for it in range(3):
    xs = harness.gradients(rng, p, n, heavy_tails=it == 1)
    want_y, want_rs = reference.spardl(xs, rs, density)
    ys, new_rs = harness.run(xs, rs, config)
    np.testing.assert_array_equal(ys, np.broadcast_to(ys[0], ys.shape))  # bit-identical
    np.testing.assert_allclose(ys[0], want_y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(new_rs, want_rs, rtol=1e-6, atol=1e-6)
    harness.assert_conserved(xs, rs, ys, new_rs)
    if density < 1:
      m, kb = reference.layout(n, p, density)
      assert np.count_nonzero(ys[0]) <= p * kb
    rs = new_rs
  want = formulas.spardl(p, n, density)
  t = harness.traffic(p, n, config)
  assert t.rounds == want["rounds"]
  for device in range(p):
    assert t.bytes_sent(device) == t.bytes_received(device) == want["bytes"]
    assert t.elements_sent(device) == want["elements"]
  assert t.others == ()  # no dense collective of any size hides in the program


@pytest.mark.parametrize("p", [1, 3, 8, 16])
def test_density_one_is_pmean(p):
  n = 999
  rng = np.random.default_rng(p)
  xs = harness.gradients(rng, p, n)
  rs = harness.gradients(rng, p, n) * 0.1
  ys, new_rs = harness.run(xs, rs, SparDLConfig(wire="exact", density=1.0))

  pmean = jax.jit(jax.shard_map(lambda a: jax.lax.pmean(a, harness.AXIS), mesh=harness.mesh(p),
                                in_specs=P(harness.AXIS), out_specs=P(harness.AXIS)))
  want = np.asarray(pmean(harness.put(p, xs + rs)))
  np.testing.assert_allclose(ys, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(new_rs, 0)


def test_all_zero_and_tied_blocks():
  p, n = 6, 600
  xs = np.zeros((p, n), np.float32)
  xs[:, 100:200] = 1.0          # a whole block of ties
  xs[2, 300:305] = -1.0         # equal magnitudes of both signs
  rs = np.zeros_like(xs)
  rs[:, 450:] = -0.0            # negative zeros
  config = SparDLConfig(wire="exact", density=0.05)
  ys, new_rs = harness.run(xs, rs, config)
  want_y, want_rs = reference.spardl(xs, rs, 0.05)
  np.testing.assert_array_equal(ys[0], want_y)
  np.testing.assert_array_equal(new_rs, want_rs)
  harness.assert_conserved(xs, rs, ys, new_rs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_matches_model_in_that_dtype(dtype):
  p, n = 4, 800
  rng = np.random.default_rng(0)
  xs = harness.gradients(rng, p, n).astype(dtype)
  rs = (harness.gradients(rng, p, n) * 0.1).astype(dtype)
  config = SparDLConfig(wire="exact", density=0.1)
  ys, new_rs = harness.run(xs, rs, config)
  assert ys.dtype == dtype and new_rs.dtype == dtype
  np.testing.assert_array_equal(ys, np.broadcast_to(ys[0], ys.shape))
  want_y, want_rs = reference.spardl(xs, rs, 0.1)  # the model computes in `dtype` too
  np.testing.assert_array_equal(ys[0], want_y)
  np.testing.assert_array_equal(new_rs, want_rs)
  total = new_rs.astype(np.float64).sum(0) + p * ys[0].astype(np.float64)
  np.testing.assert_allclose(total, (xs.astype(np.float64) + rs).sum(0), rtol=1e-2, atol=5e-2)


def test_works_under_jit_with_replicated_input_and_an_initial_state():
  p, n = 4, 300
  config = SparDLConfig(wire="exact", density=0.1)
  mesh = harness.mesh(p)

  def step(x):  # x comes in replicated: the same gradient on every device
    y, state = spardl_allreduce(x, SparDLState.initial(n), config,
                                   axis_name=harness.AXIS)
    return y[None], state.residual[None]

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=(P(harness.AXIS),) * 2))
  x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
  ys, rs = map(np.asarray, f(jax.device_put(x, jax.NamedSharding(mesh, P()))))
  want_y, want_rs = reference.spardl(np.tile(x, (p, 1)), np.zeros((p, n), np.float32), 0.1)
  np.testing.assert_allclose(ys[0], want_y, rtol=1e-6)
  np.testing.assert_allclose(rs, want_rs, rtol=1e-6)


def test_replicated_output_with_check_vma_false():
  p, n = 5, 400
  config = SparDLConfig(wire="exact", density=0.05)

  def step(x, r):
    state = SparDLState.initial(n)._replace(residual=r[0])
    y, state = spardl_allreduce(x[0], state, config, axis_name=harness.AXIS)
    return y, state.residual[None]

  f = jax.jit(jax.shard_map(step, mesh=harness.mesh(p), in_specs=(P(harness.AXIS),) * 2,
                            out_specs=(P(), P(harness.AXIS)), check_vma=False))
  rng = np.random.default_rng(3)
  xs, rs = harness.gradients(rng, p, n), np.zeros((p, n), np.float32)
  y, new_rs = map(np.asarray, f(harness.put(p, xs), harness.put(p, rs)))
  want_y, want_rs = reference.spardl(xs, rs, 0.05)
  np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(new_rs, want_rs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("residuals", ["local", "none"])
@pytest.mark.parametrize("p", [3, 8])
def test_residual_modes_match_numpy_model(p, residuals):
  """The ablation modes: LRES keeps only own unselected gradient, 'none' keeps nothing."""
  n, density = 1237, 0.05
  config = SparDLConfig(wire="exact", density=density, residuals=residuals)
  rng = np.random.default_rng(p)
  rs = np.zeros((p, n), np.float32)
  for _ in range(2):
    xs = harness.gradients(rng, p, n)
    want_y, want_rs = reference.spardl(xs, rs, density, residuals)
    ys, new_rs = harness.run(xs, rs, config)
    np.testing.assert_allclose(ys[0], want_y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(new_rs, want_rs, rtol=1e-6, atol=1e-6)
    rs = new_rs


def test_three_syncs_in_a_scan_equal_three_calls():
  """The state contract: the state coming out has the structure of the one going in, so it
  is a lax.scan carry; B-SAG (teams=3) makes the controller part of the carry."""
  p, n, steps = 6, 61, 3  # kb = 2: a ladder of two B-SAG branches, quick to compile
  config = SparDLConfig(wire="exact", density=0.05, teams=3, sag="bruck")
  rng = np.random.default_rng(7)
  xs = np.stack([harness.gradients(rng, p, n) for _ in range(steps)])  # (steps, P, n)

  def scanned(xs, state):
    def body(state, x):
      local = jax.tree.map(lambda a: a[0], state)
      y, local = spardl_allreduce(x[0], local, config, axis_name=harness.AXIS)
      return jax.tree.map(lambda a: a[None], local), y[None]
    state, ys = jax.lax.scan(body, state, xs)
    return ys, state

  rows = P(harness.AXIS)
  f = jax.jit(jax.shard_map(scanned, mesh=harness.mesh(p), in_specs=(P(None, harness.AXIS),
                                                                      rows),
                            out_specs=(P(None, harness.AXIS), rows), check_vma=False))
  xs_sharded = jax.device_put(xs, jax.NamedSharding(harness.mesh(p), P(None, harness.AXIS)))
  ys_scan, state_scan = f(xs_sharded, harness.rows(p, n, config))

  state = harness.rows(p, n, config)
  for step in range(steps):
    ys, state = harness.run_state(xs[step], state, config)
    np.testing.assert_array_equal(np.asarray(ys_scan)[step], ys)
  for got, want in zip(jax.tree.leaves(state_scan), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert jax.tree.structure(state_scan) == jax.tree.structure(state)
