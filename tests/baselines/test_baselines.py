"""The paper's competitors (TopkA, TopkDSA, gTopk, Ok-Topk) and dense: NumPy models,
conservation, bit-identical devices, any P, HLO traffic equal to their formulas, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spardl_jax as sj
from spardl_jax._src.baselines import common, gtopk, oktopk, topkdsa
from tests import formulas, harness, reference_baselines

MODELS = {"topka": reference_baselines.topka, "topkdsa": reference_baselines.topkdsa,
          "gtopk": reference_baselines.gtopk}


def run(p, method, xs, state):
  exe = harness.method_executable(p, xs.shape[1], method, xs.dtype)
  ys, state = exe(harness.put(p, xs), state)
  return np.asarray(ys), state


def assert_traffic(method, p, n):
  """The compiled program's collectives against the cost table (tests/formulas.py)."""
  hlo = harness.method_traffic(p, n, method)
  assert [(c.op, c.operands) for c in hlo.others] == harness.nonfinite_agreement(method)
  sent = [hlo.bytes_sent(d) for d in range(p)]
  density = method.config.density
  if method.name == "gtopk":
    assert sent == formulas.gtopk(p, n, density)
    assert hlo.rounds == 2 * formulas.log(p)
    return
  capacity = {"capacity": method.config.capacity} if hasattr(method.config, "capacity") else {}
  want = getattr(formulas, method.name)(p, n, density, **capacity)
  assert hlo.rounds == want["rounds"]
  assert sent == [want["bytes"]] * p


# Each method at 5 % on P = 1, 3, 8 (one device, odd, a power of two: gTopk's tree with and
# without a missing partner) and at density 1 on P = 2, 4, 6.
@pytest.mark.parametrize("name,p,density", harness.grid(
    [(name, p, d) for name in sorted(MODELS) for p in (1, 2, 3, 4, 6, 8) for d in (1.0, 0.05)],
    [(name, p, d) for name in sorted(MODELS)
     for p, d in ((1, 0.05), (3, 0.05), (8, 0.05), (2, 1.0), (4, 1.0), (6, 1.0))]))
def test_matches_numpy_model(name, p, density):
  n = 1237
  method = sj.methods.make(name, density=density)
  state = harness.method_rows(p, n, method)
  rng = np.random.default_rng(p)
  for it in range(2):
    xs = harness.gradients(rng, p, n, heavy_tails=it == 1)
    rs = np.asarray(state.residual)
    ys, state = run(p, method, xs, state)
    want_y, want_rs = MODELS[name](xs, rs, density)
    np.testing.assert_array_equal(ys, np.broadcast_to(ys[0], ys.shape))
    np.testing.assert_allclose(ys[0], want_y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(state.residual), want_rs, rtol=1e-6, atol=1e-6)
    harness.assert_conserved(xs, rs, ys, np.asarray(state.residual))
    if density == 1:
      np.testing.assert_allclose(ys[0], (xs + rs).mean(0), rtol=1e-5, atol=1e-6)
  assert_traffic(method, p, n)  # the same compiled program


def test_topkdsa_overflow_stays_in_the_residual_and_dense_gather():
  """A tiny capacity overflows every region (entries wait in the residual); a small capacity
  and large gradients in the first region overflow that one only, on every worker, and the
  others fit; a large capacity gathers dense."""
  p, n = 4, 1000
  quiet = harness.gradients(np.random.default_rng(0), p, n)
  loud = quiet * np.where(np.arange(n) < n // p, 10, 1).astype(quiet.dtype)
  for xs, capacity, dense in [(quiet, 0.25, False), (loud, 0.6, False), (quiet, 8.0, True)]:
    method = sj.methods.make("topkdsa", density=0.2, capacity=capacity)
    assert topkdsa.sizes(p, n, method.config)[3] == dense
    state = harness.method_rows(p, n, method)
    ys, state = run(p, method, xs, state)
    want_y, want_rs = reference_baselines.topkdsa(xs, np.zeros_like(xs), 0.2, capacity)
    np.testing.assert_allclose(ys[0], want_y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(state.residual), want_rs, rtol=1e-6)


@pytest.mark.parametrize("p", [2, 5, 6, 8])
def test_oktopk_conserves_and_agrees_on_every_device(p):
  n = 2000
  method = sj.methods.make("oktopk", density=0.05, tau=3, tau_regions=2)
  k, c = oktopk.capacity(p, n, method.config)
  state = harness.method_rows(p, n, method)
  rng = np.random.default_rng(p)
  for it in range(7):
    xs = harness.gradients(rng, p, n, heavy_tails=it % 2 == 1)
    rs = np.asarray(state.residual)
    ys, state = run(p, method, xs, state)
    np.testing.assert_array_equal(ys, np.broadcast_to(ys[0], ys.shape))
    harness.assert_conserved(xs, rs, ys, np.asarray(state.residual))
    for leaf in (state.global_threshold, state.boundaries):
      np.testing.assert_array_equal(np.asarray(leaf), np.asarray(leaf)[:1].repeat(p, 0))
    bounds = np.asarray(state.boundaries)[0]
    assert bounds[0] == 0 and bounds[-1] == n and np.all(np.diff(bounds) >= 0)
    if it % 3 == 0:  # re-estimation step: the exact global top-k (capacity allowing)
      assert np.count_nonzero(ys[0]) <= max(k, 1) + p  # ties at the threshold may add a few
    assert np.count_nonzero(ys[0]) <= p * c
  assert_traffic(method, p, n)  # the same compiled program


@pytest.mark.parametrize("p", [2, 5, 6])
def test_oktopk_matches_numpy_model(p):
  """Thresholds re-estimated every 3 steps, regions re-balanced every 2, capacity overflow."""
  n = 1500
  options = dict(capacity=1.5, tau=3, tau_regions=2)
  method = sj.methods.make("oktopk", density=0.05, **options)
  state = harness.method_rows(p, n, method)
  want = reference_baselines.oktopk_init(p, n)
  rng = np.random.default_rng(p)
  for it in range(6):
    xs = harness.gradients(rng, p, n, heavy_tails=it % 2 == 1)
    ys, state = run(p, method, xs, state)
    want_y, want = reference_baselines.oktopk(xs, want, 0.05, **options)
    np.testing.assert_allclose(ys[0], want_y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(state.residual), want["residual"], rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state.boundaries)[0], want["bounds"])


def test_oktopk_with_exact_thresholds_is_pmean_at_density_one():
  p, n = 3, 600
  method = sj.methods.make("oktopk", density=1.0, tau=1)
  state = harness.method_rows(p, n, method)
  rng = np.random.default_rng(0)
  for _ in range(3):
    xs = harness.gradients(rng, p, n)
    rs = np.asarray(state.residual)
    ys, state = run(p, method, xs, state)
    np.testing.assert_allclose(ys[0], (xs + rs).mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.residual), 0, atol=1e-6)


@pytest.mark.parametrize("p", [2, 3, 6, 8])
def test_dense_is_one_allreduce_of_the_gradient(p):
  """Dense: one XLA all-reduce of the whole gradient, nothing else (the other methods'
  traffic is checked in the tests against their NumPy models, on the same programs)."""
  hlo = harness.method_traffic(p, 3000, sj.methods.make("dense"))
  assert hlo.rounds == 0 and [c.op for c in hlo.others] == ["all-reduce"]
  assert hlo.largest_other() == 3000


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
def test_dense_bf16_matches_its_numpy_model_and_the_ring_cost(p):
  """x / P rounded to bfloat16, summed in bfloat16 around the ring, cast back: bit for bit
  the NumPy model's, the same on every device, no state; bfloat16 on the wire (2 (P - 1)
  rounds of ceil(n / P) values)."""
  n = 1237
  method = sj.methods.make("dense_bf16")
  xs = harness.gradients(np.random.default_rng(p), p, n, heavy_tails=True)
  ys, state = run(p, method, xs, harness.method_rows(p, n, method))
  assert state == () and ys.dtype == np.float32
  np.testing.assert_array_equal(ys, np.broadcast_to(ys[0], ys.shape))
  np.testing.assert_array_equal(ys[0], reference_baselines.dense_bf16(xs))
  assert p == 1 or not np.array_equal(ys[0], xs.mean(0))  # really rounded
  hlo = harness.method_traffic(p, n, method)
  assert not hlo.others and hlo.rounds == 2 * (p - 1)
  assert [hlo.bytes_sent(d) for d in range(p)] == [formulas.dense_bf16(p, n)] * p


def test_gtopk_bytes_per_device_follow_the_tree():
  """The code's own gTopk formula (used for SyncStats) agrees with the tree, rank by rank."""
  k_pair = 10 * 8
  # Ranks 0..5: 0 merges 1, 2, 4; 2 merges 3; 4 merges 5. A rank sends once up its edge
  # and once down each child's edge.
  want = [3 * k_pair, 1 * k_pair, 2 * k_pair, 1 * k_pair, 2 * k_pair, 1 * k_pair]
  assert formulas.gtopk(6, 1000, 0.01) == want
  assert list(gtopk.formula(6, 1000, gtopk.GTopkConfig(density=0.01)).bytes_per_device) == want


@pytest.mark.parametrize("name,options,match", [
    ("topka", {"density": 0}, "density"),
    ("topkdsa", {"density": 0.1, "capacity": 0}, "capacity must be positive"),
    ("gtopk", {"density": 2.0}, "density"),
    ("oktopk", {"density": 0.1, "tau": 0}, "tau must be positive"),
    ("oktopk", {"density": 0.1, "tau_regions": 1.5}, "tau_regions must be positive"),
])
def test_bad_options(name, options, match):
  with pytest.raises(ValueError, match=match):
    sj.methods.make(name, **options)


def test_bad_input_is_caught_at_trace_time():
  method = sj.methods.make("gtopk", density=0.1)
  with pytest.raises(ValueError, match="gtopk_allreduce: the residual is"):
    jax.eval_shape(jax.shard_map(
        lambda x: method.apply(x[0], common.ResidualState(jnp.zeros(5)),
                               axis_name="data")[0][None],
        mesh=harness.mesh(2), in_specs=jax.sharding.PartitionSpec("data"),
        out_specs=jax.sharding.PartitionSpec("data")), harness.put(2, jnp.zeros((2, 8))))
  with pytest.raises(TypeError):
    sj.methods.make("topka", density=0.1, teams=2)
