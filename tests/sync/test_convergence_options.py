"""The convergence options of the sync (dense warm-up, density schedule, DGC's momentum
correction and factor masking, SparseLoCo's residual decay; DGC's local clipping as the optax
clip before the sync) against NumPy
models built on the SparDL and TopkA references, conservation with every option on, and a
jit cache bounded by the levels."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spardl_jax as sj
from tests import formulas, harness, reference, reference_baselines

N = 300


def rows(rng, p, steps):
  """``steps`` rounds of (P, N) float32 local gradients with uneven magnitudes."""
  return [harness.gradients(rng, p, N, heavy_tails=True) for _ in range(steps)]


def with_local_clipping(sync, clip, p):
  """DGC's local clipping before ``sync`` (what ``clip_norm=`` of the sync was): each device
  clips its own gradient to norm ``clip / sqrt(P)``."""
  return sync if clip is None else optax.chain(optax.clip_by_global_norm(clip / np.sqrt(p)),
                                               sync)


def the_sync(state):
  """The SyncState of a sync's state, alone or anywhere in a chain's."""
  return next(s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
      x, sj.states.SyncState)) if isinstance(s, sj.states.SyncState))


def run(tx, grads_per_step, p):
  """Feeds each step's (P, N) gradients; yields (y, residuals (P, N), velocity or None,
  stats) after each step."""
  params = {"w": jnp.zeros((N,))}
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  f = harness.update_fn(tx, p, params)
  for g in grads_per_step:
    updates, state = f(harness.put_rows(p, {"w": jnp.asarray(g)}), state)
    sync = the_sync(state)
    velocity = None if sync.velocity is None else np.asarray(sync.velocity)
    yield (np.asarray(updates["w"]), np.asarray(sync.method_state.residual), velocity,
           sync.stats)


def clipped(g, clip, p):
  """DGC local clipping: each row rescaled to norm <= clip / sqrt(P) (float64 model)."""
  norms = np.linalg.norm(g.astype(np.float64), axis=1, keepdims=True)
  return g * np.minimum(1.0, clip / np.sqrt(p) / np.maximum(norms, 1e-30))


def model(grads_per_step, *, p, density, warmup=0, momentum=None, masking=True, clip=None,
          decay=None):
  """The NumPy model: ``density`` is a number or [(step, density), ...]."""
  schedule = [(0, density)] if np.isscalar(density) else density
  rs = np.zeros((p, N), np.float32)
  u = np.zeros((p, N), np.float32)
  for step, g in enumerate(grads_per_step):
    if decay is not None:
      rs = (decay * rs).astype(np.float32)
    if clip is not None:
      g = clipped(g, clip, p).astype(np.float32)
    if momentum is not None:
      u = (momentum * u + g).astype(np.float32)
      g = u
    if step < warmup:
      y = (g + rs).astype(np.float64).mean(0)
      rs = np.zeros_like(rs)
    else:
      d = [d for s, d in schedule if s <= step][-1]
      y, rs = reference.spardl(g, rs, d, wire="compact")  # the default format
      if momentum is not None and masking:
        u = np.where(y[None] != 0, 0, u).astype(np.float32)
    yield y, rs, (u if momentum is not None else None), g


def assert_matches(tx, p, steps, seed=0, **options):
  grads = rows(np.random.default_rng(seed), p, steps)
  for (y, rs, u, _), (my, mrs, mu, _) in zip(run(tx, grads, p), model(grads, p=p, **options)):
    np.testing.assert_allclose(y, my, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rs, mrs, rtol=1e-5, atol=1e-5)
    if mu is not None:
      np.testing.assert_allclose(u, mu, rtol=1e-5, atol=1e-5)


def test_dense_warmup_then_sparse():
  """Warm-up steps are pmean of gradient plus residual (which empties); then SparDL."""
  assert_matches(sj.spardl(density=0.05, warmup_steps=2), 3, 4, warmup=2, density=0.05)


def test_density_schedule_moves_through_levels():
  schedule = [(0, 0.3), (2, 0.1), (3, 0.02)]
  assert_matches(sj.spardl(density=schedule, warmup_steps=1), 4, 5, warmup=1, density=schedule)


def by_hand(p):
  """docs/design.md's rule: 2.5 % at P = 8, times log2 P / 3, at most 10 %."""
  return min(0.1, 0.025 * np.log2(max(p, 2)) / 3)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_density_auto_is_the_rule_at_each_p(p):
  """The density is picked when the sync is traced, from the devices it runs on; the
  sync is then SparDL at that density (the NumPy model), and the stats say which."""
  assert_matches(sj.spardl(density="auto"), p, 3, density=by_hand(p))
  grads = rows(np.random.default_rng(1), p, 1)
  *_, stats = next(run(sj.spardl(density="auto"), grads, p))
  np.testing.assert_allclose(np.asarray(stats.density), by_hand(p), rtol=1e-6)


def test_density_auto_with_teams_and_the_makers():
  """Teams and R-SAG hold with the rule (the model with d = 2 at P = 8); the method maker
  and the spec parser take it with the devices."""
  grads = rows(np.random.default_rng(2), 8, 2)
  rs = np.zeros((8, N), np.float32)
  for (y, got_rs, *_), g in zip(run(sj.spardl(density="auto", teams=2), grads, 8), grads):
    want, rs = reference.spardl(g, rs, by_hand(8), teams=2, sag="recursive", wire="compact")
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_rs, rs, rtol=1e-5, atol=1e-5)
  assert sj.options.parse("spardl:density=auto") == ("spardl", {"density": "auto"})
  for p in (8, 64, 2 ** 12, 2 ** 20):
    assert sj.methods.make("spardl", p=p, density="auto").config.density == pytest.approx(
        by_hand(p))
  rule = sj.density_rule(0.01, at=4, most=0.03)
  assert [rule(p) for p in (4, 16, 2 ** 10)] == pytest.approx([0.01, 0.02, 0.03])


@pytest.mark.parametrize("masking", [True, False])
def test_momentum_correction_and_masking(masking):
  assert_matches(sj.spardl(density=0.05, momentum=0.9, momentum_masking=masking), 4, 4,
                 density=0.05, momentum=0.9, masking=masking)


def test_local_clipping():
  """DGC's local clipping, an optax clip of each device's gradient before the sync."""
  assert_matches(with_local_clipping(sj.spardl(density=0.05), 3.0, 4), 4, 3, density=0.05,
                 clip=3.0)


def test_density_one_momentum_correction_is_momentum_sgd():
  """At density 1 without masking, SGD after a momentum-corrected sync == momentum SGD on
  the mean gradient (the momentum moved before the sync, where it is linear)."""
  p, lr, m = 4, 0.1, 0.9
  grads = rows(np.random.default_rng(3), p, 4)
  tx = optax.chain(sj.spardl(density=1.0, wire="exact", momentum=m, momentum_masking=False),
                   optax.sgd(lr))
  velocity = np.zeros(N)
  for (y, rs, _, _), g in zip(run(tx, grads, p), grads):
    velocity = m * velocity + g.astype(np.float64).mean(0)
    np.testing.assert_allclose(y, -lr * velocity, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(rs, 0)


def test_density_one_with_masking_is_plain_sgd():
  """Masking zeroes the velocity wherever the result is nonzero: at density 1, everywhere."""
  p = 4
  grads = rows(np.random.default_rng(4), p, 3)
  tx = sj.spardl(density=1.0, wire="exact", momentum=0.9)
  for (y, _, u, _), g in zip(run(tx, grads, p), grads):
    np.testing.assert_allclose(y, g.astype(np.float64).mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(u, 0)


OPTIONS = {
    "warmup": dict(warmup_steps=2),
    "schedule": dict(density=[(0, 0.3), (1, 0.1), (3, 0.02)]),
    "momentum": dict(momentum=0.9),
    "momentum, no masking": dict(momentum=0.5, momentum_masking=False),
    "clipping": dict(clip=2.0),
    "residual decay": dict(residual_decay=0.8),
    "all": dict(warmup_steps=1, density=[(0, 0.2), (2, 0.05)], momentum=0.9, clip=2.0,
                residual_decay=0.9),
}


# Every option together at two P, and the two that change what the residual accumulates
# alone (each option alone with SPARDL_JAX_FULL_TESTS=1; each is held to the model above).
@pytest.mark.parametrize("name,p", harness.grid(
    [(name, 8) for name in OPTIONS] + [("all", 5)],
    [("all", 8), ("all", 5), ("schedule", 8), ("momentum, no masking", 8)]))
def test_conservation_with_each_option(name, p):
  """sum(new residuals) + P y == sum(accumulated + decayed old residuals), the accumulated
  being the clipped gradient or the velocity before masking (from the model,
  independently)."""
  options = {"density": 0.05, **OPTIONS[name]}
  momentum = options.get("momentum")
  grads = rows(np.random.default_rng(p), p, 5)
  rs = np.zeros((p, N))
  model_options = dict(p=p, density=options["density"], warmup=options.get("warmup_steps", 0),
                       momentum=momentum, masking=options.get("momentum_masking", True),
                       clip=options.get("clip"), decay=options.get("residual_decay"))
  decay = options.get("residual_decay", 1.0)
  clip = options.pop("clip", None)
  for (y, new_rs, _, _), (_, _, _, accumulated) in zip(
      run(with_local_clipping(sj.spardl(**options), clip, p), grads, p),
      model(grads, **model_options)):
    harness.assert_conserved(accumulated, decay * rs, np.broadcast_to(y, (p, N)), new_rs)
    rs = new_rs


@pytest.mark.parametrize("method", ["spardl", "topka"])
def test_residual_decay_against_the_models(method):
  """SparseLoCo's e <- beta e + g: each step sees the residual scaled by beta first, for
  SparDL (with a dense warm-up step, which delivers the decayed residual) and TopkA; a
  skipped step leaves the residual as it was, undecayed."""
  p, beta, density = 4, 0.7, 0.05
  grads = rows(np.random.default_rng(11), p, 4)
  warmup = 1 if method == "spardl" else 0
  tx = sj.sync_gradients(method, density=density, residual_decay=beta, warmup_steps=warmup)
  rs = np.zeros((p, N), np.float32)
  got = list(run(tx, grads + [np.full((p, N), np.nan, np.float32)], p))
  if method == "spardl":
    want = [(y, r) for y, r, _, _ in model(grads, p=p, density=density, warmup=1, decay=beta)]
  else:
    want = []
    for g in grads:
      y, rs = reference_baselines.topka(g, (beta * rs).astype(np.float32), density)
      want.append((y, rs))
  for (y, new_rs, _, _), (want_y, want_rs) in zip(got, want):
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_rs, want_rs, rtol=1e-5, atol=1e-6)
  skipped_y, skipped_rs, _, stats = got[-1]
  np.testing.assert_array_equal(skipped_y, 0)
  np.testing.assert_array_equal(skipped_rs, got[-2][1])
  np.testing.assert_array_equal(stats.nonfinite, 1)


def test_levels_compile_once_and_count_their_bytes():
  """Crossing every level boundary reuses one executable (the jit cache holds 1 <= levels
  entries); each step's bytes are its level's formula (dense ring, then SparDL)."""
  p = 8
  schedule = [(0, 0.25), (2, 0.0625), (3, 0.01)]
  tx = sj.spardl(density=schedule, warmup_steps=2)
  params = {"w": jnp.zeros((N,))}
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  f = harness.update_fn(tx, p, params)
  grads = rows(np.random.default_rng(0), p, 6)
  want = [(1.0, formulas.dense(p, N)["bytes"])] * 2 + [
      (d, formulas.spardl(p, N, d, wire="compact")["bytes"])
      for d in (0.0625, 0.01, 0.01, 0.01)]
  for g, (density, nbytes) in zip(grads, want):
    _, state = f(harness.put_rows(p, {"w": jnp.asarray(g)}), state)
    np.testing.assert_allclose(state.stats.density, density)
    np.testing.assert_array_equal(state.stats.bytes_sent, nbytes)
  assert f._cache_size() == 1
  np.testing.assert_array_equal(state.count, 6)


def test_bad_options_are_named():
  with pytest.raises(ValueError, match=r"residual_decay must be None or a number in \[0, 1\]"):
    sj.spardl(residual_decay=1.5)
  with pytest.raises(ValueError, match="residual_decay=0.9 decays the error feedback, but "
                                       "'dense' keeps none"):
    sj.init_opt_state(sj.sync_gradients("dense", residual_decay=0.9), {"w": jnp.zeros((4,))},
                      harness.mesh(2))
  with pytest.raises(ValueError, match="momentum must be None or a number in"):
    sj.spardl(momentum=1.0)
  with pytest.raises(ValueError, match="momentum_masking must be True or False"):
    sj.spardl(momentum=0.9, momentum_masking="yes")
  with pytest.raises(TypeError, match=r"clip_norm is retired.*optax.clip_by_global_norm"):
    sj.spardl(clip_norm=1.0)
  with pytest.raises(ValueError, match="warmup_steps must be an int >= 0"):
    sj.spardl(warmup_steps=-1)
  with pytest.raises(ValueError, match="steps must start at 0 and increase strictly"):
    sj.spardl(density=[(5, 0.1), (10, 0.01)])
  with pytest.raises(ValueError, match=r"list of \(step, density\) pairs"):
    sj.spardl(density=[])
  with pytest.raises(ValueError, match="density"):
    sj.spardl(density=[(0, 0.1), (10, 2.0)])
  with pytest.raises(ValueError, match="target must be in"):
    sj.density_warmup(0.0, steps=10)


def test_density_warmup_is_dgc_schedule():
  """25 % divided by 4 while it stays above the target, equal intervals, then the target."""
  assert sj.density_warmup(0.001, steps=400) == [
      (0, 0.25), (100, 0.0625), (200, 0.015625), (300, 0.00390625), (400, 0.001)]
  assert sj.density_warmup(0.01, steps=90, at=30) == [
      (0, 0.01), (30, 0.25), (60, 0.0625), (90, 0.015625), (120, 0.01)]
  # Fewer steps than levels: one step each, the rest dropped; nothing to do at the target.
  assert sj.density_warmup(0.001, steps=2) == [(0, 0.25), (1, 0.0625), (2, 0.001)]
  assert sj.density_warmup(0.25, steps=10) == [(0, 0.25)]
