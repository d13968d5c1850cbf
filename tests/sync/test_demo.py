"""sj.demo against a NumPy DeMo on P devices built on the TopkA and SparDL references: each
device's momentum decayed and added to, its top-k sent and kept out, the sign of the mean as
the update with decoupled weight decay; a skipped step moves nothing but the decay."""

import jax.numpy as jnp
import numpy as np
import pytest

import spardl_jax as sj
from tests import harness, reference, reference_baselines

P, N = 4, 64
LR, WD, BETA, DENSITY = 0.01, 0.1, 0.9, 0.05


def numpy_demo(grads, params, send):
  """(updates, the mean sent, momenta) after each step; ``send(xs, rs)`` is the method's
  NumPy model, returning the mean of what it sent and the new residuals."""
  momenta = np.zeros((P, N), np.float32)
  for g in grads:
    y, momenta = send(g, (BETA * momenta).astype(np.float32))
    yield -LR * (np.sign(y) + WD * params), y, momenta


# Each method's NumPy model, and its options (SparDL's exact wire: the model's values).
SENDS = {
    "topka": (lambda xs, rs: reference_baselines.topka(xs, rs, DENSITY), {}),
    "spardl": (lambda xs, rs: reference.spardl(xs, rs, density=DENSITY)[:2],
               {"wire": "exact"}),
}


@pytest.mark.parametrize("method", sorted(SENDS))
def test_matches_numpy_demo_and_keeps_the_momentum(method):
  rng = np.random.default_rng(4)
  params = {"w": jnp.asarray(rng.standard_normal(N), jnp.float32)}
  grads = [harness.gradients(rng, P, N, heavy_tails=True) for _ in range(3)]
  send, options = SENDS[method]
  tx = sj.demo(LR, method=method, density=DENSITY, decay=BETA, weight_decay=WD, **options)
  state = sj.init_opt_state(tx, params, harness.mesh(P))
  f = harness.update_fn(tx, P, params)
  want = numpy_demo(grads, np.asarray(params["w"]), send)
  momenta = np.zeros((P, N), np.float32)
  for g, (want_update, sent, want_momenta) in zip(grads, want):
    updates, state = f(harness.put_rows(P, {"w": jnp.asarray(g)}), state)
    np.testing.assert_allclose(updates["w"], want_update, rtol=1e-6, atol=1e-7)
    residual = np.asarray(state[0].method_state.residual)
    np.testing.assert_allclose(residual, want_momenta, rtol=1e-5, atol=1e-5)
    # Nothing is lost: what the model's devices sent plus what these devices kept is the
    # decayed momentum plus the gradient.
    harness.assert_conserved(g, BETA * momenta, np.broadcast_to(sent, (P, N)), residual)
    momenta = residual
  assert np.count_nonzero(np.asarray(updates["w"]) != -LR * WD * np.asarray(params["w"])) > 0


def test_a_skipped_step_moves_only_the_weight_decay():
  params = {"w": jnp.ones((N,), jnp.float32)}
  tx = sj.demo(LR, density=DENSITY, decay=BETA, weight_decay=WD)
  state = sj.init_opt_state(tx, params, harness.mesh(P))
  f = harness.update_fn(tx, P, params)
  g = harness.gradients(np.random.default_rng(0), P, N)
  _, state = f(harness.put_rows(P, {"w": jnp.asarray(g)}), state)
  before = np.asarray(state[0].method_state.residual)
  bad = g.copy()
  bad[1, 3] = np.nan
  updates, state = f(harness.put_rows(P, {"w": jnp.asarray(bad)}), state)
  np.testing.assert_allclose(updates["w"], -LR * WD * np.ones(N), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(state[0].method_state.residual), before)
  np.testing.assert_array_equal(state[0].stats.nonfinite, 1)


def test_bad_options_are_named():
  with pytest.raises(ValueError, match="demo: method must be a sparse method with error "
                                       "feedback, one of .*'topka'.*, got 'dense'"):
    sj.demo(1e-3, method="dense")
  with pytest.raises(ValueError, match=r"demo: decay must be a number in \[0, 1\]"):
    sj.demo(1e-3, decay=1.5)
  with pytest.raises(ValueError, match="demo: weight_decay must be a finite number >= 0"):
    sj.demo(1e-3, weight_decay=-1)
  with pytest.raises(ValueError, match="demo: learning_rate must be a finite number >= 0"):
    sj.demo(float("nan"))
  with pytest.raises(ValueError, match="demo: residual_decay=0.5 would put a second "
                                       "momentum"):
    sj.demo(1e-3, residual_decay=0.5)
