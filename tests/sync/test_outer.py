"""The outer loop (DiLoCo): against per-step sync training at H = 1, against a NumPy DiLoCo
model with a dense and a SparDL outer sync, the pseudo-gradient's conservation, SparseLoCo's
outer round (decayed error feedback, chunked top-k, 2-bit values, a plain outer step) against
its NumPy model, bit-identical parameters on every device, its state's layout and folding,
and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import spardl_jax as sj
from tests import harness, reference, reference_baselines

AXIS = harness.AXIS
N = 7  # one parameter vector: w[:6] weights, w[6] the bias


def step_fn(tx, p, grad, batch_args):
  """``(step, state)``: one train step on P devices, each taking ``grad(replica params,
  *its batch rows)`` (``batch_args`` arrays, each sharded over the devices);
  ``step(params, state, *batch)`` returns every device's copy of the new parameters
  ``(P, N)``."""
  params = jnp.zeros((N,), jnp.float32)
  mesh = harness.mesh(p)
  specs = sj.opt_state_specs(tx, params, mesh)

  def local(params, state, *batch):
    grads = grad(sj.points.replica_params(state, params), *(rows[0] for rows in batch))
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates)[None], state

  step = jax.jit(jax.shard_map(local, mesh=mesh,
                               in_specs=(P(), specs) + (P(AXIS),) * batch_args,
                               out_specs=(P(AXIS), specs), check_vma=False))
  return step, sj.init_opt_state(tx, params, mesh)


def least_squares_grad(w, x, y):
  return jax.grad(lambda w: jnp.mean((x @ w[:6] + w[6] - y) ** 2))(w)


def linear_step(tx, p):
  """:func:`step_fn` for a loss linear in the parameters: each device's gradient is its
  row of ``c``, whatever the parameters (the gradient of ``<c, w>``)."""
  return step_fn(tx, p, lambda w, c: c, 1)


def numpy_diloco(w, batches, *, every, lr, momentum, outer_lr, outer_momentum, sync):
  """DiLoCo in NumPy: per replica, SGD with momentum (optax's trace) from the global ``w``
  for ``every`` steps; the pseudo-gradient ``w - local`` averaged by ``sync((P, N)) -> (N,)``;
  the outer Nesterov step (optax's: ``t = g + mu t``, step ``-lr (g + mu t)``)."""
  p = batches[0][0].shape[0]
  velocity = np.zeros((p, N), np.float32)
  outer_trace = np.zeros(N, np.float32)
  local = np.repeat(w[None], p, axis=0)
  for t, (x, y) in enumerate(batches):
    for i in range(p):
      err = x[i] @ local[i, :6] + local[i, 6] - y[i]
      g = np.concatenate([2 * x[i].T @ err, [2 * err.sum()]]) / len(y[i])
      velocity[i] = g + momentum * velocity[i]
      local[i] = local[i] - lr * velocity[i]
    if (t + 1) % every == 0:
      mean = sync(w[None] - local)
      outer_trace = mean + outer_momentum * outer_trace
      w = w - outer_lr * (mean + outer_momentum * outer_trace)
      local = np.repeat(w[None], p, axis=0)
  return w


def batches_for(rng, p, steps):
  return [(rng.standard_normal((p, 8, 6)).astype(np.float32),
           rng.standard_normal((p, 8)).astype(np.float32)) for _ in range(steps)]


def train(tx, p, batches):
  params = jnp.zeros((N,), jnp.float32)
  step, state = step_fn(tx, p, least_squares_grad, 2)
  for x, y in batches:
    copies, state = step(params, state, harness.put_rows(p, x), harness.put_rows(p, y))
    copies = np.asarray(copies)
    np.testing.assert_array_equal(copies, np.broadcast_to(copies[0], copies.shape))
    params = jnp.asarray(copies[0])
  return np.asarray(params), state


def test_every_step_with_identity_outer_is_per_step_sync_training():
  """H = 1, inner SGD, outer SGD at lr 1, density 1 and the exact wire: the sync's own
  training with SGD, to float32 rounding."""
  p, lr = 4, 0.05
  batches = batches_for(np.random.default_rng(0), p, 5)
  exact = sj.spardl(density=1.0, wire="exact")
  got, _ = train(sj.diloco(optax.sgd(lr), exact, every=1, outer=optax.sgd(1.0)), p, batches)
  want, _ = train(optax.chain(exact, optax.sgd(lr)), p, batches)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", ["dense", "spardl"])
def test_matches_numpy_diloco_for_three_outer_rounds(method):
  """Momentum SGD inside, DiLoCo's default Nesterov outer step, H = 3, 3 rounds; the SparDL
  outer sync at 30 %, int4 values, its residual carried between rounds."""
  p, every, lr = 4, 3, 0.05
  batches = batches_for(np.random.default_rng(1), p, 3 * every)
  if method == "dense":
    sync = sj.sync_gradients("dense")

    def model_sync(pseudo):
      return pseudo.mean(axis=0)
  else:
    sync = sj.spardl(density=0.3, wire="int4")
    residuals = [np.zeros((p, N), np.float32)]

    def model_sync(pseudo):
      y, residuals[0] = reference.spardl(pseudo, residuals[0], 0.3, wire="int4")
      return y
  tx = sj.diloco(optax.sgd(lr, momentum=0.9), sync, every=every)
  got, state = train(tx, p, batches)
  want = numpy_diloco(np.zeros(N, np.float32), batches, every=every, lr=lr, momentum=0.9,
                      outer_lr=0.7, outer_momentum=0.9, sync=model_sync)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
  assert int(state.count) == 3 * every
  assert not np.asarray(state.offset).any()  # every round ends on the global parameters
  if method == "spardl":
    np.testing.assert_allclose(np.asarray(state.sync.method_state.residual), residuals[0],
                               rtol=2e-5, atol=2e-6)


def test_sparse_outer_sync_conserves_the_pseudo_gradient():
  """A loss linear in the parameters makes each replica's pseudo-gradient known in advance
  (minus its summed gradients); with the outer step ``-mean`` the residuals and the mean
  account for every bit of it, round after round, at 2-bit values, and only outer steps
  send bytes."""
  p, every, density = 4, 2, 0.3
  rng = np.random.default_rng(2)
  tx = sj.diloco(optax.identity(), sj.spardl(density=density, wire="int2"), every=every,
                 outer=optax.sgd(1.0))
  step, state = linear_step(tx, p)
  params = jnp.zeros((N,), jnp.float32)
  residual = np.zeros((p, N), np.float32)
  for _ in range(3):
    cs = [harness.gradients(rng, p, N) for _ in range(every)]
    for t, c in enumerate(cs):
      copies, state = step(params, state, harness.put_rows(p, c))
      sent = np.asarray(sj.sync_stats(state).bytes_sent)
      assert (sent > 0).all() == (t == every - 1)
    copies = np.asarray(copies)
    np.testing.assert_array_equal(copies, np.broadcast_to(copies[0], copies.shape))
    mean = np.asarray(params) - copies[0]
    pseudo = -np.sum(cs, axis=0)  # identity inner steps: the offset sums the gradients
    new_residual = np.asarray(state.sync.method_state.residual)
    harness.assert_conserved(pseudo, residual, mean[None], new_residual)
    want_y, want_rs = reference.spardl(pseudo, residual, density, wire="int2")
    np.testing.assert_allclose(mean, want_y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(new_residual, want_rs, rtol=1e-6, atol=1e-6)
    params, residual = jnp.asarray(copies[0]), new_residual


@pytest.mark.parametrize("method", ["sparseloco", "spardl"])
def test_sparseloco_rounds_match_the_numpy_model(method):
  """SparseLoCo's round (Algorithm 1 of its paper) for a loss linear in the parameters:
  e <- beta e + pseudo; its compressed part averaged over the replicas (SparseLoCo's chunked
  top-k with 2-bit values, or SparDL under the same rule); e keeps the rest, so
  e_new + sent == beta e + pseudo; the parameters move by -lr * mean, with no momentum."""
  p, every, density, beta, lr = 4, 2, 0.3, 0.8, 0.5
  rng = np.random.default_rng(5)
  options = {"bits": 2, "chunk": 4} if method == "sparseloco" else {"wire": "exact"}
  tx = sj.sparseloco(optax.identity(), every=every, density=density, decay=beta, lr=lr,
                     method=method, **options)
  step, state = linear_step(tx, p)
  params = jnp.zeros((N,), jnp.float32)
  residual = np.zeros((p, N), np.float32)
  for _ in range(3):
    cs = [harness.gradients(rng, p, N) for _ in range(every)]
    for c in cs:
      copies, state = step(params, state, harness.put_rows(p, c))
    copies = np.asarray(copies)
    np.testing.assert_array_equal(copies, np.broadcast_to(copies[0], copies.shape))
    mean = (np.asarray(params) - copies[0]) / lr
    pseudo = -np.sum(cs, axis=0)
    decayed = (beta * residual).astype(np.float32)
    if method == "sparseloco":  # N = 7: two chunks of 4 and 3 entries, 2 and 1 kept
      want_y, want_rs = reference_baselines.sparseloco(pseudo, decayed, [(N,)], density, 4, 2)
    else:
      want_y, want_rs = reference.spardl(pseudo, decayed, density, wire="exact")
    new_residual = np.asarray(state.sync.method_state.residual)
    harness.assert_conserved(pseudo, decayed, mean[None], new_residual)
    np.testing.assert_allclose(mean, want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new_residual, want_rs, rtol=1e-5, atol=1e-5)
    assert not jax.tree.leaves(state.outer)  # a plain outer step keeps no momentum
    params, residual = jnp.asarray(copies[0]), new_residual


def test_state_layout_and_fold_rules():
  """Offsets and the inner state per replica (a leading data axis), the outer state like
  the parameters; a restore onto another replica count averages the offsets."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
  params = {"w": jax.ShapeDtypeStruct((6, 4), jnp.float32), "b": jax.ShapeDtypeStruct(
      (4,), jnp.float32)}
  tx = sj.diloco(optax.adam(1e-3), sj.spardl(density=0.1), every=5)
  specs = sj.opt_state_specs(tx, params, mesh, param_specs={"w": P(None, "model"), "b": P()})
  assert specs.offset == {"w": P("data", None, "model"), "b": P("data")}
  assert specs.inner[0].mu["w"] == P("data", None, "model")
  assert specs.inner[0].count == P("data")
  assert specs.outer[0].trace["w"] == P(None, "model")
  assert specs.count == P()
  alone = sj.diloco(optax.adam(1e-3), sj.spardl(density=0.1, axis_size=4), every=5)
  rules = sj.checkpoint.fold_rules(jax.eval_shape(alone.init, params))
  assert rules.offset == {"w": "mean", "b": "mean"}
  assert rules.sync.method_state.residual == "sum"


@pytest.mark.parametrize("kwargs,match", [
    ({"every": 0}, r"every .* must be an int in \[1, 2\*\*31 - 1\], got 0"),
    ({"every": 2.5}, r"every .* must be an int in \[1, 2\*\*31 - 1\]"),
    ({"every": 2**31}, r"every .* must be an int in \[1, 2\*\*31 - 1\], got 2147483648"),
    ({"every": 3, "outer": "sgd"}, "outer must be an optax.GradientTransformation"),
])
def test_bad_options_are_named(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    sj.diloco(optax.sgd(0.1), sj.spardl(), **kwargs)


def test_sparseloco_bad_options_are_named():
  with pytest.raises(ValueError, match="sparseloco: lr must be a finite number > 0, got 0"):
    sj.sparseloco(optax.sgd(0.1), every=3, lr=0)
  with pytest.raises(ValueError, match=r"residual_decay must be None or a number in \[0, 1\]"):
    sj.sparseloco(optax.sgd(0.1), every=3, decay=1.2)
  with pytest.raises(ValueError, match=r"bits must be one of \(2, 4, 8, None\), got 1"):
    sj.sparseloco(optax.sgd(0.1), every=3, bits=1)


def test_a_sync_in_the_wrong_place_is_refused():
  mesh = harness.mesh(2)
  params = jnp.zeros((N,))
  with pytest.raises(ValueError, match="inner holds a gradient sync"):
    sj.init_opt_state(sj.diloco(optax.chain(sj.spardl(), optax.sgd(0.1)), sj.spardl(),
                                every=2), params, mesh)
  with pytest.raises(ValueError, match="sync must be a gradient sync"):
    sj.init_opt_state(sj.diloco(optax.sgd(0.1), optax.chain(sj.spardl(), optax.sgd(1.0)),
                                every=2), params, mesh)
  with pytest.raises(ValueError, match="update needs params"):
    tx = sj.diloco(optax.sgd(0.1), sj.spardl(axis_size=2), every=2)
    state = tx.init(params)
    tx.update(params, state)


def test_a_state_of_another_period_is_refused():
  """Its count would end the rounds at other steps than the ones it was begun for."""
  sync = sj.spardl(density=0.5, axis_size=2)
  params = jnp.zeros((N,))
  state = sj.diloco(optax.sgd(0.1), sync, every=3).init(params)
  with pytest.raises(ValueError, match="the state was built for every=3, this step has "
                                       "every=5; init with the same diloco"):
    sj.diloco(optax.sgd(0.1), sync, every=5).update(params, state, params)


def test_a_nonfinite_gradient_skips_only_that_replicas_inner_step():
  """A NaN in one device's gradient on an inner step: that replica's offset and momentum
  stay, the others move; the outer step after it is finite and the same on every device."""
  p = 4
  tx = sj.diloco(optax.sgd(0.1, momentum=0.9), sj.spardl(density=0.5), every=2)
  step, state = linear_step(tx, p)
  params = jnp.zeros((N,), jnp.float32)
  c = harness.gradients(np.random.default_rng(3), p, N)
  c[2, 4] = np.nan
  _, state = step(params, state, harness.put_rows(p, c))
  offset = np.asarray(state.offset)
  assert not offset[2].any() and not np.asarray(state.inner[0].trace)[2].any()
  assert all(offset[i].any() for i in (0, 1, 3))
  copies, state = step(params, state, harness.put_rows(p, np.ones((p, N), np.float32)))
  copies = np.asarray(copies)
  assert np.isfinite(copies).all() and copies.any()
  np.testing.assert_array_equal(copies, np.broadcast_to(copies[0], copies.shape))


def test_a_hierarchical_sync_is_refused_in_an_outer_loop():
  mesh = jax.make_mesh((2, 2), ("host", "local"), devices=jax.devices()[:4])
  tx = sj.diloco(optax.sgd(0.1), sj.spardl(axis_name="host", local_axis="local"), every=2)
  params = jnp.zeros((N,))
  state = sj.init_opt_state(tx, params, mesh, axis_name="host")
  step = sj.data_parallel_step(lambda w, x: jnp.sum(x @ w), tx, mesh, axis_name="host",
                               local_axis="local")
  x = jax.device_put(jnp.ones((4, N)), jax.sharding.NamedSharding(mesh, P(("host", "local"))))
  with pytest.raises(ValueError, match="a replica per device of 'host'.*Drop local_axis"):
    step(params, state, x)


def test_a_skipped_outer_sync_drops_the_round_and_keeps_the_residual():
  """An inner optimizer that overflows to inf on one replica: the outer sync's agreed guard
  skips, every device returns a zero update, the offsets restart and the residual stays."""
  p = 2
  tx = sj.diloco(optax.scale(1e38), sj.spardl(density=0.5), every=1, outer=optax.sgd(1.0))
  step, state = linear_step(tx, p)
  params = jnp.zeros((N,), jnp.float32)
  _, state = step(params, state, harness.put_rows(p, np.full((p, N), 1e-37, np.float32)))
  before = np.asarray(state.sync.method_state.residual)
  assert before.any()
  c = np.full((p, N), 1e-37, np.float32)
  c[1] = 10.0  # 1e39: inf on replica 1
  copies, state = step(params, state, harness.put_rows(p, c))
  np.testing.assert_array_equal(np.asarray(copies), 0.0)
  assert not np.asarray(state.offset).any()
  np.testing.assert_array_equal(np.asarray(state.sync.method_state.residual), before)
  assert int(np.asarray(sj.sync_stats(state).nonfinite)[0]) == 1
