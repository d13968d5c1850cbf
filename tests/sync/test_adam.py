"""scale_by_frozen_adam against a NumPy Adam whose second moment stops at freeze_step."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spardl_jax as sj


def numpy_adam(grads, *, freeze_step, b1, b2, eps):
  mu = np.zeros_like(grads[0], np.float64)
  nu = np.zeros_like(grads[0], np.float64)
  for t, g in enumerate(grads, start=1):
    mu = b1 * mu + (1 - b1) * g
    if t <= freeze_step:
      nu = b2 * nu + (1 - b2) * g * g
    t_nu = min(t, freeze_step)
    yield (mu / (1 - b1 ** t)) / (np.sqrt(nu / (1 - b2 ** t_nu)) + eps)


@pytest.mark.parametrize("b1", [0.9, 0.0])
def test_matches_numpy_and_equals_adam_before_the_freeze(b1):
  rng = np.random.default_rng(0)
  grads = [rng.standard_normal(7).astype(np.float32) * (1 + 10 * (t % 3 == 0)) for t in range(8)]
  tx = sj.scale_by_frozen_adam(freeze_step=3, b1=b1, b2=0.99, eps=1e-8)
  adam = optax.scale_by_adam(b1=b1, b2=0.99, eps=1e-8)
  state, adam_state = tx.init(jnp.zeros(7)), adam.init(jnp.zeros(7))
  for t, (g, want) in enumerate(zip(grads, numpy_adam(grads, freeze_step=3, b1=b1, b2=0.99,
                                                      eps=1e-8)), start=1):
    out, state = tx.update(jnp.asarray(g), state)
    plain, adam_state = adam.update(jnp.asarray(g), adam_state)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=1e-6)
    if t <= 3:
      np.testing.assert_allclose(out, plain, rtol=2e-5, atol=1e-6)
  assert int(state.count) == 8


def test_bad_options_are_named():
  with pytest.raises(ValueError, match="freeze_step must be an int >= 1"):
    sj.scale_by_frozen_adam(freeze_step=0)
  with pytest.raises(ValueError, match="b2 must be in"):
    sj.scale_by_frozen_adam(freeze_step=5, b2=1.0)
