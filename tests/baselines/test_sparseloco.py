"""SparseLoCo's aggregation against a NumPy model written from its module docstring (chunks
per leaf, stable-argsort top-k per chunk, the statistical quantizer per leaf), conservation
of the error mass, pmean at density 1 with float values, the compiled all-gather's bytes
against the message arithmetic, and bad options."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import spardl_jax as sj
from tests import harness
from tests.reference_baselines import chunks_of, sparseloco as numpy_sparseloco

# A matrix cut into several chunks, a vector of one chunk, a leaf of one entry, a kernel.
SHAPES = ((30, 40), (7,), (1,), (3, 3, 4))
N = sum(math.prod(s) for s in SHAPES)
CHUNK = 256


def method(density, bits, chunk=CHUNK):
  return sj.methods.make("sparseloco", density=density, chunk=chunk, bits=bits).for_leaves(
      SHAPES)


def message_bytes(p, shapes, density, chunk, bits):
  """Bytes one device sends: P - 1 messages of 16-bit positions, then the values
  (bits each, or float32), then one table of 1 + 2^bits float32 per leaf, each part in whole
  32-bit words."""
  kept = 0
  for shape in shapes:
    c, count = chunks_of(math.prod(shape), chunk)
    kept += count * min(c, max(1, math.ceil(density * c)))
  words = math.ceil(kept / 2)
  words += kept if bits is None else math.ceil(kept * bits / 32) + len(shapes) * (1 + 2 ** bits)
  return (p - 1) * 4 * words


# Each value format at P = 3; P = 1 and 4 once.
@pytest.mark.parametrize("p,bits", harness.grid(
    [(p, bits) for p in (1, 3, 4) for bits in (2, 4, None)],
    [(1, 2), (3, 2), (3, 4), (3, None), (4, 4)]))
def test_matches_numpy_model_conserves_and_sends_its_message(p, bits):
  m = method(0.05, bits)
  state = harness.method_rows(p, N, m)
  rs = np.zeros((p, N))
  rng = np.random.default_rng(p)
  exe = harness.method_executable(p, N, m)
  for it in range(3):  # fed back: the error carries the quantization error too
    xs = harness.gradients(rng, p, N, heavy_tails=it == 1)
    ys, state = exe(harness.put(p, xs), state)
    ys = np.asarray(ys)
    want_y, want_rs = numpy_sparseloco(xs, rs, SHAPES, 0.05, CHUNK, bits)
    np.testing.assert_array_equal(ys, np.broadcast_to(ys[0], ys.shape))
    np.testing.assert_allclose(ys[0], want_y, rtol=1e-5, atol=1e-5)
    # A value alone in its bin decodes to itself only up to float32 rounding (mean + offset),
    # so the residual it leaves is 0 within the rounding of that value's own size.
    np.testing.assert_array_less(np.abs(np.asarray(state.residual) - want_rs),
                                 1e-5 * (1 + np.abs(xs + rs)))
    harness.assert_conserved(xs, rs, ys, np.asarray(state.residual))
    rs = np.asarray(state.residual, np.float64)
  hlo = harness.method_traffic(p, N, m)
  assert [hlo.bytes_sent(d) for d in range(p)] == [message_bytes(p, SHAPES, 0.05, CHUNK, bits)] * p
  assert hlo.rounds == (p - 1).bit_length()
  assert m.formula(p=p, n=N, itemsize=4).bytes == message_bytes(p, SHAPES, 0.05, CHUNK, bits)


def test_two_bit_values_take_four_levels_per_leaf_and_the_chunks_split_the_selection():
  p = 2
  m = method(0.1, 2)
  xs = harness.gradients(np.random.default_rng(7), p, N)
  ys, state = harness.method_executable(p, N, m)(harness.put(p, xs),
                                                 harness.method_rows(p, N, m))
  sent = xs - np.asarray(state.residual)  # what each device sent, decoded
  for w in range(p):
    leaf = sent[w, :1200]  # the (30, 40) matrix: 5 chunks of 240, 24 kept in each
    assert len(np.unique(leaf[leaf != 0])) <= 4
    assert [int(np.count_nonzero(leaf[j * 240:(j + 1) * 240])) for j in range(5)] == [24] * 5


def test_density_one_with_float_values_is_pmean():
  p = 4
  m = method(1.0, None)
  xs = harness.gradients(np.random.default_rng(3), p, N)
  ys, state = harness.method_executable(p, N, m)(harness.put(p, xs),
                                                 harness.method_rows(p, N, m))
  np.testing.assert_allclose(np.asarray(ys)[0], xs.mean(0), rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(state.residual), 0)


def test_through_the_optax_sync_on_a_small_model():
  """Bound to the leaves by the transformation: the result's nonzeros are whole chunks'
  selections of every device, and the error mass is conserved across steps."""
  p = 4
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}
  tx = sj.sync_gradients("sparseloco", density=0.02, chunk=512)
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  f = harness.update_fn(tx, p, params)
  rng = np.random.default_rng(0)
  total = np.zeros(64 * 32 + 32)
  delivered = np.zeros_like(total)
  for _ in range(3):
    grads = {k: rng.standard_normal((p, *v.shape)).astype(np.float32) for k, v in params.items()}
    total += np.concatenate([grads["b"].reshape(p, -1), grads["w"].reshape(p, -1)],
                            axis=1).sum(0)
    updates, state = f(harness.put_rows(p, {k: jnp.asarray(v) for k, v in grads.items()}), state)
    delivered += p * np.concatenate([np.asarray(updates["b"]).reshape(-1),
                                     np.asarray(updates["w"]).reshape(-1)])
    # (64, 32) is 4 chunks of 512 keeping 11 each; (32,) one chunk keeping 1; per device.
    assert 0 < np.count_nonzero(updates["w"]) <= p * 4 * 11
  residual = np.asarray(state.method_state.residual).sum(0)
  np.testing.assert_allclose(residual + delivered, total, rtol=1e-4, atol=1e-4)


def test_bad_options_are_named():
  with pytest.raises(ValueError, match=r"bits must be one of \(2, 4, 8, None\), got 3"):
    sj.methods.make("sparseloco", density=0.01, bits=3)
  with pytest.raises(ValueError, match=r"chunk must be an int in \[1, 65536\]"):
    sj.methods.make("sparseloco", density=0.01, chunk=70000)
  with pytest.raises(ValueError, match="sigmas must be a finite number > 0"):
    sj.methods.make("sparseloco", density=0.01, sigmas=0)
  with pytest.raises(ValueError, match="density must be in"):
    sj.methods.make("sparseloco", density=0)
  with pytest.raises(ValueError, match="leaf shapes"):
    sj.methods.make("sparseloco", density=0.1).for_leaves(((3, 3),)).init(
        n=10, dtype=jnp.float32, p=2)
