"""`sync_gradients(dense_leaves=...)`: the leaves a rule keeps dense are each device's exact
mean (NumPy), the rest is SparDL on their flat vector alone (the NumPy model), the books stay
exact, a non-finite dense leaf skips the whole step, and the bytes the stats report are the
compiled HLO's (SparDL's cost plus one ring all-reduce of the dense leaves, tests/formulas.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spardl_jax as sj
from spardl_jax.tools import traffic
from tests import formulas, harness, reference

PARAMS = {"w": jnp.zeros((24, 10), jnp.float32), "b": jnp.zeros((10,), jnp.float32),
          "scale": jnp.zeros((7,), jnp.float32), "small": jnp.zeros((3, 3), jnp.float32)}


def grads_of(rng, p):
  return {k: jnp.asarray(rng.standard_normal((p, *v.shape)), v.dtype) for k, v in PARAMS.items()}


@pytest.mark.parametrize("rule, dense", [("vectors", ("b", "scale")),
                                         (20, ("b", "scale", "small")),
                                         (lambda shape: shape == (3, 3), ("small",))])
def test_dense_leaves_are_the_mean_and_the_rest_is_spardl(rule, dense):
  p = 4
  tx = sj.spardl(density=0.1, dense_leaves=rule, wire="exact")
  state = sj.init_opt_state(tx, PARAMS, harness.mesh(p))
  f = harness.update_fn(tx, p, PARAMS)
  rng = np.random.default_rng(0)
  sparse = [k for k in sorted(PARAMS) if k not in dense]  # tree order: sorted dict keys
  rs = np.zeros((p, sum(PARAMS[k].size for k in sparse)), np.float32)
  for _ in range(3):
    grads = grads_of(rng, p)
    updates, state = f(harness.put_rows(p, grads), state)
    for k in dense:  # each device's exact mean
      np.testing.assert_allclose(updates[k], np.asarray(grads[k]).mean(0), rtol=1e-6,
                                 atol=1e-7)
    flat = harness.flat_rows(grads, sparse, p)
    y, new_rs = reference.spardl(flat, rs, 0.1)
    harness.assert_synced(updates, np.asarray(state.method_state.residual), sparse,
                          (y, new_rs), (flat, rs), atol=(1e-7, 1e-6))
    rs = new_rs
  stats = sj.sync_stats(state)
  n_dense = sum(PARAMS[k].size for k in dense)
  assert int(np.asarray(stats.selected)[0]) == np.count_nonzero(y) + n_dense


def test_a_nonfinite_dense_leaf_skips_the_whole_step():
  p = 4
  tx = sj.spardl(density=0.1, dense_leaves="vectors")
  state = sj.init_opt_state(tx, PARAMS, harness.mesh(p))
  f = harness.update_fn(tx, p, PARAMS)
  rng = np.random.default_rng(1)
  _, state = f(harness.put_rows(p, grads_of(rng, p)), state)
  before = np.asarray(state.method_state.residual)
  grads = grads_of(rng, p)
  grads["b"] = grads["b"].at[2, 3].set(jnp.nan)  # one device, one bias entry
  updates, state = f(harness.put_rows(p, grads), state)
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  np.testing.assert_array_equal(np.asarray(state.method_state.residual), before)
  np.testing.assert_array_equal(np.asarray(state.stats.nonfinite), 1)


def test_stats_bytes_are_the_compiled_traffic():
  p = 4
  params = {"w": jnp.zeros((4000,)), "b": jnp.zeros((64,)), "g": jnp.zeros((36,))}
  tx = sj.spardl(density=0.01, dense_leaves=100, wire="exact")
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  f = harness.update_fn(tx, p, params)
  grads = harness.put_rows(p, {k: np.random.default_rng(2).standard_normal(
      (p, *v.shape)).astype(np.float32) for k, v in params.items()})
  _, state = f(grads, state)
  hlo = traffic.parse_hlo(f.lower(grads, state).compile().as_text())
  # SparDL's permutes for the 4,000-entry vector, and one all-reduce of the dense leaves'
  # 100 entries (its bytes are a ring's: XLA's all-reduce shows no pairs to count).
  assert hlo.bytes_sent(0) == formulas.spardl(p, 4000, 0.01)["bytes"]
  reduced = [c.elements for c in hlo.others if c.op.startswith("all-reduce")]
  assert max(reduced) == 100
  np.testing.assert_array_equal(state.stats.bytes_sent,
                                hlo.bytes_sent(0) + formulas.dense(p, max(reduced))["bytes"])


def test_with_synced_adamw_and_sgd():
  """The option reaches the sync through synced_adamw and an SGD chain alike."""
  p = 4
  for tx in (sj.synced_adamw(1e-2, warmup_steps=1, density=0.1, dense_leaves="vectors"),
             optax.chain(sj.spardl(density=0.1, dense_leaves="vectors"), optax.sgd(0.1))):
    state = sj.init_opt_state(tx, PARAMS, harness.mesh(p))
    f = harness.update_fn(tx, p, PARAMS)
    rng = np.random.default_rng(3)
    for _ in range(2):  # the second step is sparse
      updates, state = f(harness.put_rows(p, grads_of(rng, p)), state)
    assert all(np.all(np.asarray(updates[k]) != 0) for k in ("b", "scale"))


@pytest.mark.parametrize("kwargs, match", [
    (dict(dense_leaves="matrices"), r"dense_leaves must be None, vectors, an int N"),
    (dict(dense_leaves=0), r"dense_leaves must be None"),
    (dict(dense_leaves=True), r"dense_leaves must be None"),
    (dict(dense_leaves="vectors", momentum=0.9), r"dense_leaves='vectors' with momentum=0.9"),
])
def test_bad_dense_leaves_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sj.spardl(density=0.1, **kwargs)


def test_a_rule_that_keeps_every_leaf_dense_is_named():
  tx = sj.spardl(density=0.1, dense_leaves=10**9)
  with pytest.raises(ValueError, match="keeps every leaf dense"):
    sj.init_opt_state(tx, PARAMS, harness.mesh(4))
