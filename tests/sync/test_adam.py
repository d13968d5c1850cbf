"""scale_by_frozen_adam against a NumPy Adam whose second moment stops at freeze_step;
scale_by_synced_adam (the momentum through the sync) against a NumPy model on P devices built
on the SparDL reference."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spardl_jax as sj
from tests import formulas, harness, reference


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
  tx = sj.adam.scale_by_frozen_adam(freeze_step=3, b1=b1, b2=0.99, eps=1e-8)
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
    sj.adam.scale_by_frozen_adam(freeze_step=0)
  with pytest.raises(ValueError, match="b2 must be in"):
    sj.adam.scale_by_frozen_adam(freeze_step=5, b2=1.0)


def test_a_skipped_step_does_not_train_the_second_moment():
  """A sync that skipped a non-finite step returns zeros everywhere: inside the warm-up that
  step neither decays nu nor counts in its bias correction, so the frozen nu (and every
  update after the freeze) is the one of the warm-up without it. mu decays as Adam's does."""
  rng = np.random.default_rng(1)
  grads = [jnp.asarray(rng.standard_normal(7), jnp.float32) for _ in range(6)]
  tx = sj.adam.scale_by_frozen_adam(freeze_step=4, b1=0.0, b2=0.99)
  clean, skipped = tx.init(jnp.zeros(7)), tx.init(jnp.zeros(7))
  for g in grads[:3]:
    _, clean = tx.update(g, clean)
  for g in [grads[0], jnp.zeros(7), grads[1], grads[2]]:
    _, skipped = tx.update(g, skipped)
  np.testing.assert_array_equal(np.asarray(skipped.nu), np.asarray(clean.nu))
  assert (int(skipped.nu_count), int(clean.nu_count)) == (3, 3)
  # After the freeze, updates use the nu of the three real warm-up gradients (NumPy model).
  out, skipped = tx.update(grads[3], skipped)
  assert (int(skipped.count), int(skipped.nu_count)) == (5, 3)
  want = list(numpy_adam([np.asarray(g) for g in grads[:4]], freeze_step=3, b1=0.0, b2=0.99,
                         eps=1e-8))[-1]
  np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=1e-6)


def numpy_synced_adam(grads, *, warmup, freeze_step, density, b1, b2, eps,
                      second_moment="frozen"):
  """P devices: m_i = b1 m + (1 - b1) g_i; the sync's mean of the m_i (dense with the
  residual delivered during the warm-up, then SparDL on the exact wire with its residuals);
  v trained on the true mean gradient until freeze_step, then frozen, or ('sent') trained
  where the sync delivered: a coordinate delivered a steps after its last delivery gets
  v <- b2^a v + (1 - b2^a) (mean / a)^2, with a more steps in its own bias correction; or
  ('refreshed', 0/1 Adam's) frozen but for steps 2W, 4W, 8W, ... (W = freeze_step), where
  the true mean gradient trains every coordinate once."""
  p, n = grads[0].shape
  m, v = np.zeros(n), np.zeros(n)
  covered, last = np.zeros(n), np.zeros(n)
  rs = np.zeros((p, n), np.float32)
  for t, g in enumerate(grads, start=1):
    local = (b1 * m + (1 - b1) * g).astype(np.float32)
    if t <= warmup:
      new = (local + rs).astype(np.float64).mean(0)
      rs = np.zeros_like(rs)
    else:
      new, rs = reference.spardl(local, rs, density, wire="exact")
    ratio = t // freeze_step
    refresh = (second_moment == "refreshed" and t % freeze_step == 0 and ratio >= 2
               and ratio & (ratio - 1) == 0)
    if t <= freeze_step or refresh:
      hit, age, mean = np.ones(n, bool), np.ones(n), g.astype(np.float64).mean(0)
    else:
      hit = (new != 0) & (second_moment == "sent")
      age, mean = t - last, (new - b1 * m) / (1 - b1)
    v = np.where(hit, b2 ** age * v + (1 - b2 ** age) * (mean / age) ** 2, v)
    covered = np.where(hit, covered + age, covered)
    last = np.where(hit, t, last)
    m = new
    yield (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** covered)) + eps), rs


def test_second_moment_trains_where_the_sync_delivers():
  """second_moment='sent' against its NumPy model (SparDL at 20 %, so coordinates wait
  several steps), and synced_adamw is that transformation with AdamW's decay and -lr."""
  p, n, b1, b2, eps, lr, wd = 4, 60, 0.9, 0.99, 1e-8, 0.1, 0.01
  rng = np.random.default_rng(4)
  grads = [harness.gradients(rng, p, n) for _ in range(7)]
  params = {"w": jnp.asarray(rng.standard_normal(n), jnp.float32)}
  tx = sj.synced_adamw(lr, warmup_steps=2, density=0.2, wire="exact", b1=b1, b2=b2, eps=eps,
                       weight_decay=wd, dense_leaves=None)
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  f = harness.update_fn(tx, p, params)
  want = numpy_synced_adam(grads, warmup=2, freeze_step=2, density=0.2, b1=b1, b2=b2,
                           eps=eps, second_moment="sent")
  ages = []
  for t, (g, (want_adam, _)) in enumerate(zip(grads, want), start=1):
    out, state = f(harness.put_rows(p, {"w": jnp.asarray(g)}), state)
    np.testing.assert_allclose(np.asarray(out["w"]),
                               -lr * (want_adam + wd * np.asarray(params["w"])),
                               rtol=2e-4, atol=1e-5)
    ages.append(t - np.asarray(state[0].sent_at["w"]))
  assert np.asarray(ages[-1]).max() >= 2  # some coordinates waited, and were trained late


def test_refreshed_second_moment_matches_its_numpy_model_and_counts_its_bytes():
  """second_moment='refreshed' (0/1 Adam's schedule) against its NumPy model: v frozen after
  a 2-step warm-up but at steps 4 and 8, where the dense mean gradient trains it; those
  steps send SparDL's bytes plus a float32 ring all-reduce of the gradient (the cost
  table's formulas), the others SparDL's alone. A non-finite gradient at a refresh step
  changes no moment."""
  p, n, b1, b2, eps, density = 4, 60, 0.9, 0.99, 1e-8, 0.2
  rng = np.random.default_rng(5)
  grads = [harness.gradients(rng, p, n) for _ in range(7)]
  tx = sj.adam.scale_by_synced_adam(sj.spardl(density=density, wire="exact", warmup_steps=2),
                                    freeze_step=2, b1=b1, b2=b2, eps=eps,
                                    second_moment="refreshed")
  params = {"w": jnp.zeros((n,))}
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  f = harness.update_fn(tx, p, params)
  want = numpy_synced_adam(grads, warmup=2, freeze_step=2, density=density, b1=b1, b2=b2,
                           eps=eps, second_moment="refreshed")
  sparse = formulas.spardl(p, n, density)["bytes"]
  for t, (g, (want_out, _)) in enumerate(zip(grads, want), start=1):
    out, state = f(harness.put_rows(p, {"w": jnp.asarray(g)}), state)
    np.testing.assert_allclose(np.asarray(out["w"]), want_out, rtol=2e-4, atol=1e-4)
    if t > 2:
      extra = formulas.dense(p, n)["bytes"] if t == 4 else 0
      np.testing.assert_array_equal(np.asarray(state.sync.stats.bytes_sent), sparse + extra)
  assert set(np.asarray(state.nu_count["w"]).tolist()) == {3}  # the warm-up's 2, step 4's
  before = [np.asarray(x) for x in (state.mu["w"], state.nu["w"], state.nu_count["w"])]
  out, state = f(harness.put_rows(p, {"w": jnp.full((p, n), jnp.nan)}), state)  # step 8
  np.testing.assert_array_equal(np.asarray(out["w"]), 0)
  for got, was in zip((state.mu["w"], state.nu["w"], state.nu_count["w"]), before):
    np.testing.assert_array_equal(np.asarray(got), was)


def test_synced_adam_matches_its_numpy_model():
  """Two dense steps train v on the mean gradient (recovered from the synced momentum), then
  the momentum goes through SparDL at 30 % with its error feedback; a non-finite step
  changes nothing and returns zeros."""
  p, n, b1, b2, eps = 4, 50, 0.9, 0.99, 1e-8
  rng = np.random.default_rng(3)
  grads = [harness.gradients(rng, p, n) for _ in range(5)]
  tx = sj.adam.scale_by_synced_adam(sj.spardl(density=0.3, wire="exact", warmup_steps=2),
                               freeze_step=2, b1=b1, b2=b2, eps=eps)
  params = {"w": jnp.zeros((n,))}
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  f = harness.update_fn(tx, p, params)
  want = numpy_synced_adam(grads, warmup=2, freeze_step=2, density=0.3, b1=b1, b2=b2, eps=eps)
  for g, (want_out, want_rs) in zip(grads, want):
    out, state = f(harness.put_rows(p, {"w": jnp.asarray(g)}), state)
    np.testing.assert_allclose(np.asarray(out["w"]), want_out, rtol=2e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(state.sync.method_state.residual), want_rs,
                               rtol=1e-5, atol=1e-6)
  before = [np.asarray(x) for x in (state.mu["w"], state.nu["w"])]
  out, state = f(harness.put_rows(p, {"w": jnp.full((p, n), jnp.nan)}), state)
  np.testing.assert_array_equal(np.asarray(out["w"]), 0)
  for got, was in zip((state.mu["w"], state.nu["w"]), before):
    np.testing.assert_array_equal(np.asarray(got), was)
  assert int(state.count) == 6 and set(np.asarray(state.nu_count["w"]).tolist()) == {2}


def numpy_preconditioned_adam(grads, *, warmup, density, b1, b2, eps):
  """P devices, freeze_step = warmup: plain Adam on the dense mean gradient while v trains;
  then each device sends g_i / D (D = sqrt(v_hat) + eps, frozen) through SparDL on the exact
  wire with its residuals, and the mean times D updates m."""
  p, n = grads[0].shape
  m, v = np.zeros(n), np.zeros(n)
  rs = np.zeros((p, n), np.float32)
  for t, g in enumerate(grads, start=1):
    if t <= warmup:
      mean = g.astype(np.float64).mean(0)
      v = b2 * v + (1 - b2) * mean ** 2
    d = np.sqrt(v / (1 - b2 ** min(t, warmup))) + eps
    if t > warmup:
      sent, rs = reference.spardl((g / d).astype(np.float32), rs, density, wire="exact")
      mean = sent * d
    m = b1 * m + (1 - b1) * mean
    yield (m / (1 - b1 ** t)) / d, rs


def test_preconditioned_sync_matches_its_numpy_model_and_is_frozen_adam_when_dense():
  """sends='preconditioned': SparDL at 30 % ranks g / D after a 2-step warm-up (NumPy
  model); at density 1 the result is scale_by_frozen_adam of the mean gradient."""
  p, n, b1, b2, eps = 4, 50, 0.9, 0.99, 1e-8
  rng = np.random.default_rng(5)
  grads = [harness.gradients(rng, p, n) for _ in range(5)]
  params = {"w": jnp.zeros((n,))}
  frozen = sj.adam.scale_by_frozen_adam(freeze_step=2, b1=b1, b2=b2, eps=eps)
  frozen_state = frozen.init(params)
  for density in (0.3, 1.0):
    tx = sj.adam.scale_by_synced_adam(sj.spardl(density=density, wire="exact", warmup_steps=2),
                                 freeze_step=2, b1=b1, b2=b2, eps=eps, sends="preconditioned")
    state = sj.init_opt_state(tx, params, harness.mesh(p))
    f = harness.update_fn(tx, p, params)
    want = numpy_preconditioned_adam(grads, warmup=2, density=density, b1=b1, b2=b2, eps=eps)
    for g, (want_out, want_rs) in zip(grads, want):
      out, state = f(harness.put_rows(p, {"w": jnp.asarray(g)}), state)
      np.testing.assert_allclose(np.asarray(out["w"]), want_out, rtol=2e-4, atol=1e-4)
      np.testing.assert_allclose(np.asarray(state.sync.method_state.residual), want_rs,
                                 rtol=1e-5, atol=1e-6)
      if density == 1.0:
        dense, frozen_state = frozen.update({"w": jnp.asarray(g.mean(0))}, frozen_state)
        np.testing.assert_allclose(np.asarray(out["w"]), np.asarray(dense["w"]), rtol=2e-4,
                                   atol=1e-4)


def test_synced_adam_bad_input_is_named():
  with pytest.raises(ValueError, match="sends must be one of .'momentum', 'preconditioned'.,"
                                       " got 'gradient'"):
    sj.adam.scale_by_synced_adam(sj.spardl(), freeze_step=3, sends="gradient")
  with pytest.raises(ValueError, match="second_moment must be one of .'frozen', 'sent', "
                                       "'refreshed'.,"):
    sj.adam.scale_by_synced_adam(sj.spardl(), freeze_step=3, second_moment="adaptive")
  with pytest.raises(ValueError, match="second_moment='refreshed' averages the gradient over "
                                       "the sync's data axes .* not a chain"):
    sj.adam.scale_by_synced_adam(optax.chain(sj.spardl()), freeze_step=3,
                                 second_moment="refreshed")
  with pytest.raises(ValueError, match="synced_adamw: warmup_steps must be an int >= 1, got 0"):
    sj.synced_adamw(1e-3, warmup_steps=0)
  with pytest.raises(ValueError, match="nosuch"):
    sj.synced_adamw(1e-3, warmup_steps=3, method="nosuch")
  # A method without a density takes none (PowerSGD's rank instead).
  assert sj.synced_adamw(1e-3, warmup_steps=3, method="powersgd", rank=2)
  with pytest.raises(ValueError, match="scale_by_synced_adam: freeze_step must be an int >= 1"):
    sj.adam.scale_by_synced_adam(sj.spardl(), freeze_step=0)
  with pytest.raises(TypeError, match="sync must be an optax.GradientTransformation"):
    sj.adam.scale_by_synced_adam("spardl", freeze_step=3)
  with pytest.raises(ValueError, match="not a chain"):
    sj.init_opt_state(sj.adam.scale_by_synced_adam(optax.chain(sj.spardl(), optax.sgd(1.0)),
                                              freeze_step=3),
                      {"w": jnp.zeros((4,))}, harness.mesh(2))


def test_adams_moments_declare_the_same_on_every_device_and_survive_a_refold():
  """Adam's moments and counts are declared SAME (the sync's state keeps its own rules) and
  placed like the parameters; restored onto another device count they come back whole."""
  import jax
  params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}
  tx = sj.synced_adamw(1e-3, warmup_steps=2, density=0.1)
  state = sj.init_opt_state(tx, params, harness.mesh(4))
  rules = sj.checkpoint.fold_rules(state)[0]
  assert set(jax.tree.leaves(rules._replace(sync=()))) == {"same"}
  assert jax.tree.leaves(rules.sync.method_state.residual) == ["sum"]
  rng = np.random.default_rng(0)
  saved = jax.tree.map(lambda a: np.asarray(rng.normal(size=a.shape), a.dtype), state)
  like = sj.init_opt_state(tx, params, harness.mesh(2))
  back = sj.checkpoint.refold(saved, like)[0]
  for got, want in zip(jax.tree.leaves(back._replace(sync=())),
                       jax.tree.leaves(saved[0]._replace(sync=()))):
    np.testing.assert_array_equal(np.asarray(got), want)
  np.testing.assert_allclose(np.asarray(back.sync.method_state.residual, np.float64).sum(0),
                             np.asarray(saved[0].sync.method_state.residual,
                                        np.float64).sum(0), rtol=1e-5, atol=1e-5)
