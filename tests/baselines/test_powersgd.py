"""PowerSGD against a NumPy model (per leaf, NumPy's QR), full rank = pmean on a small
model through the optax transformation, conservation of the error-feedback mass, the two
all-reduces of the compiled program against the ring formula, and bad options."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import spardl_jax as sj
from tests import formulas, harness

# (3, 3, 4, 6), a Flax convolution kernel, is the matrix (9, 24): of its splits (3, 72),
# (9, 24) and (36, 6), the one with the fewest rows + columns.
SHAPES = ((6, 5), (3, 4, 2), (5,), (3, 3, 4, 6), (20, 12))


def split(shape):
  """(rows, cols) of a leaf, by trying every split of its axes."""
  splits = [(math.prod(shape[:k]), math.prod(shape[k:])) for k in range(1, len(shape))]
  return min(splits, key=sum) if splits else (math.prod(shape), 1)


def numpy_powersgd(xs, rs, qs, shapes, rank, rate):
  """One PowerSGD step of P workers: (y, new residuals, new Qs); float64."""
  p = xs.shape[0]
  g = xs.astype(np.float64) + rs
  y, new_rs, new_qs, start, i = [], [], [], 0, 0
  for shape in shapes:
    size = math.prod(shape)
    rows, cols = split(shape)
    r = min(rank, rows, cols)
    block = g[:, start:start + size]
    if len(shape) >= 2 and rows * cols >= rate * r * (rows + cols):
      ms = block.reshape(p, rows, cols)
      pf = np.linalg.qr(sum(m @ qs[i] for m in ms))[0]
      q = sum(m.T @ pf for m in ms)
      mean = (pf @ q.T / p).reshape(-1)
      new_qs.append(q)
      new_rs.append(block - mean)
      i += 1
    else:
      mean = block.mean(0)
      new_rs.append(np.zeros_like(block))
    y.append(mean)
    start += size
  return np.concatenate(y), np.concatenate(new_rs, axis=1), new_qs


def method(rank, rate=1.0):
  return sj.methods.make("powersgd", rank=rank, min_compression_rate=rate).for_leaves(SHAPES)


N = sum(math.prod(s) for s in SHAPES)


@pytest.mark.parametrize("p", [1, 3, 8])
def test_matches_numpy_model_and_conserves_the_error_mass(p):
  m = method(rank=2)
  state = harness.method_rows(p, N, m)
  qs = [np.asarray(q, np.float64)[0] for q in state.qs]
  assert [q.shape for q in qs] == [(5, 2), (8, 2), (24, 2), (12, 2)]  # (5,) goes dense
  rng = np.random.default_rng(p)
  rs = np.zeros((p, N))
  for _ in range(3):  # fed back: the error and the warm-started Q
    xs = harness.gradients(rng, p, N)
    exe = harness.method_executable(p, N, m)
    ys, state = exe(harness.put(p, xs), state)
    ys = np.asarray(ys)
    want_y, want_rs, qs = numpy_powersgd(xs, rs, qs, SHAPES, 2, 1.0)
    np.testing.assert_array_equal(ys, np.broadcast_to(ys[0], ys.shape))
    np.testing.assert_allclose(ys[0], want_y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(state.residual), want_rs, rtol=1e-4, atol=1e-5)
    harness.assert_conserved(xs, rs, ys, np.asarray(state.residual))
    rs = np.asarray(state.residual, np.float64)
  if p > 1:  # two all-reduces: the P factors with the dense leaf, then the Q factors
    hlo = harness.method_traffic(p, N, m)
    first = 6 * 2 + 3 * 2 + 9 * 2 + 20 * 2 + 5
    second = 5 * 2 + 8 * 2 + 24 * 2 + 12 * 2
    assert not hlo.permutes
    agreement = [c.operands for c in hlo.others if c.elements == 1]
    assert agreement == [operands for _, operands in harness.nonfinite_agreement(m)]
    assert sorted(c.elements for c in hlo.others
                  if c.op == "all-reduce" and c.elements > 1) == sorted([first, second])
    assert m.formula(p=p, n=N, itemsize=4).bytes == (formulas.dense(p, first)["bytes"] +
                                                     formulas.dense(p, second)["bytes"])


def test_full_rank_on_a_small_model_equals_dense():
  """At full rank the projection keeps everything: PowerSGD is pmean, step after step
  (through the optax transformation, leaves of a small model, a dense step first)."""
  p = 4
  params = {"conv": jnp.zeros((3, 4, 2)), "dense": jnp.zeros((20, 12)),
            "bias": jnp.zeros((5,))}
  tx = sj.powersgd(rank=20, start_iter=1, min_compression_rate=0.01)
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  f = harness.update_fn(tx, p, params)
  rng = np.random.default_rng(0)
  for _ in range(3):
    grads = {k: jnp.asarray(rng.standard_normal((p, *v.shape)), jnp.float32)
             for k, v in params.items()}
    updates, state = f(harness.put_rows(p, grads), state)
    for k in params:
      np.testing.assert_allclose(updates[k], np.asarray(grads[k]).mean(0), rtol=1e-4,
                                 atol=1e-5)
    # Each device keeps its input minus the mean (PyTorch's error); they cancel exactly.
    np.testing.assert_allclose(np.asarray(state.method_state.residual).sum(0), 0, atol=1e-4)


def test_low_rank_differs_from_dense_and_keeps_the_rest():
  p = 4
  params = {"w": jnp.zeros((16, 16))}
  tx = sj.powersgd(rank=1)
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  grads = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((p, 16, 16)),
                            jnp.float32)}
  updates, state = harness.update_fn(tx, p, params)(harness.put_rows(p, grads), state)
  mean = np.asarray(grads["w"]).mean(0)
  assert np.linalg.matrix_rank(np.asarray(updates["w"]), tol=1e-4) == 1
  residual = np.asarray(state.method_state.residual).reshape(p, 16, 16)
  np.testing.assert_allclose(residual.sum(0) + p * np.asarray(updates["w"]),
                             np.asarray(grads["w"]).sum(0), rtol=1e-4, atol=1e-4)
  assert np.abs(np.asarray(updates["w"]) - mean).max() > 0.1


def test_bad_options_are_named():
  with pytest.raises(ValueError, match="rank must be an int >= 1"):
    sj.powersgd(rank=0)
  with pytest.raises(ValueError, match="min_compression_rate must be a number > 0"):
    sj.powersgd(min_compression_rate=0)
  with pytest.raises(ValueError, match="warmup_steps must be an int >= 0"):
    sj.powersgd(start_iter=-1)
  with pytest.raises(ValueError, match="leaf shapes"):
    sj.methods.make("powersgd").for_leaves(((3, 3),)).init(n=10, dtype=jnp.float32, p=2)
