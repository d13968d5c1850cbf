"""The look-ahead of a delayed sync (``sj.weight_prediction``): the point each device takes its
gradient at against a NumPy model (heavy ball on its estimate of the next delivery), the
delayed and looked-ahead run on a quadratic against the undelayed NumPy run one step later,
nothing stored, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import spardl_jax as sj
from tests import harness

AXIS = harness.AXIS
LR, M = 0.1, 0.9


def run(tx, p, params, data, loss, steps):
  """``steps`` train steps on P devices (device i's batch is ``data[i]``): each step's
  parameters after it and every device's look-ahead point before it."""
  mesh = harness.mesh(p)
  specs = sj.opt_state_specs(tx, params, mesh)

  def step(params, state, batch):
    point = sj.points.predicted_params(tx, state, params)
    grads = jax.grad(loss)(jax.lax.pcast(point, AXIS, to="varying"), batch[0])
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, jax.tree.map(lambda a: a[None], point)

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(AXIS)),
                            out_specs=(P(), specs, P(AXIS)), check_vma=False))
  state = sj.init_opt_state(tx, params, mesh)
  batch = harness.put_rows(p, jnp.asarray(data))
  for _ in range(steps):
    before = params
    params, state, points = f(params, state, batch)
    yield jax.tree.map(np.asarray, before), jax.tree.map(np.asarray, points), params


def quadratic(params, batch):
  """0.5 (w - c)^T A (w - c) with this device's (A, c) in ``batch`` (rows: A, then c)."""
  a, c = batch[:-1], batch[-1]
  d = params["w"] - c
  return 0.5 * d @ a @ d


def problem(rng, p, n, same):
  """P devices' (A, c) stacked as (P, n + 1, n): A symmetric positive definite with
  eigenvalues up to 9 (lr * L = 0.9 with heavy ball's m = 0.9 is stable undelayed, unstable
  delayed); the same for every device when ``same``."""
  def one():
    q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    a = (q * np.linspace(0.5, 9.0, n)) @ q.T
    return np.vstack([a, rng.normal(size=(1, n))]).astype(np.float32)
  first = one()
  return np.stack([first if same else one() for _ in range(p)])


def heavy_ball(problem_rows, steps):
  """NumPy's undelayed heavy ball on one device's quadratic from zero: the parameters before
  each step, in float64."""
  a, c = problem_rows[:-1].astype(np.float64), problem_rows[-1].astype(np.float64)
  x, v, want = np.zeros(len(c)), np.zeros(len(c)), []
  for _ in range(steps):
    want.append(x.copy())
    v = M * v + a @ (x - c)
    x = x - LR * v
  return want


def test_delayed_and_looked_ahead_is_the_undelayed_run_one_step_later():
  """Every device the same quadratic, a dense sync: the look-ahead point is exactly where the
  held gradient is applied, so the run is NumPy's undelayed heavy ball one step later (step 0
  moves nothing); without the look-ahead the same rate diverges."""
  p, n, steps = 4, 6, 40
  data = problem(np.random.default_rng(0), p, n, same=True)
  want = heavy_ball(data[0], steps)
  sync = sj.sync_gradients("dense", delay=1)
  tx = sj.weight_prediction(sync, optax.sgd(LR, momentum=M))
  got = [after["w"] for _, _, after in run(tx, p, {"w": jnp.zeros(n)}, data, quadratic, steps)]
  np.testing.assert_allclose(got[0], 0)
  for t in range(1, steps):
    np.testing.assert_allclose(got[t], want[t], rtol=1e-4, atol=1e-4 * np.abs(want[t]).max())
  plain = optax.chain(sync, optax.sgd(LR, momentum=M))
  stale = [after["w"] for _, _, after in run(plain, p, {"w": jnp.zeros(n)}, data, quadratic,
                                              steps)]
  # Unstable without the look-ahead.
  assert np.abs(stale[-1]).max() > 100 * np.abs(data[0, -1]).max()


def test_data_parallel_step_and_gradient_point_look_ahead_too():
  """The same run through ``sj.data_parallel_step`` (which asks ``sj.gradient_point``, as the
  trainer does): NumPy's undelayed heavy ball one step later; and ``gradient_point`` of a
  look-ahead chain is ``predicted_params``'s point, of a plain chain ``params`` itself."""
  p, n, steps = 4, 6, 30
  data = problem(np.random.default_rng(0), p, n, same=True)
  want = heavy_ball(data[0], steps)
  tx = sj.weight_prediction(sj.sync_gradients("dense", delay=1), optax.sgd(LR, momentum=M))
  mesh = harness.mesh(p)
  step = sj.data_parallel_step(lambda params, batch: quadratic(params, batch[0]), tx, mesh)
  params = {"w": jnp.zeros(n)}
  state = sj.init_opt_state(tx, params, mesh)
  batch = harness.put_rows(p, jnp.asarray(data))
  for t in range(steps):  # step t delivers the gradient of step t - 1 (step 0: nothing)
    params, state, _ = step(params, state, batch)
    np.testing.assert_allclose(params["w"], want[t], rtol=1e-4,
                               atol=1e-4 * np.abs(want[t]).max())
  plain = optax.chain(sj.spardl(delay=1), optax.sgd(LR))
  assert sj.gradient_point(plain, None, params) is params


def largest(v, k):
  """``v`` with all but its ``k`` entries of the largest magnitude zeroed."""
  out = np.zeros_like(v)
  keep = np.argsort(-np.abs(v), kind="stable")[:k]
  out[keep] = v[keep]
  return out


def test_each_device_looks_ahead_on_its_own_estimate_and_nothing_is_stored():
  """Devices with different quadratics, SparDL at 30 % of n = 6, looking ahead by half:
  device i's point is ``params - lr (m v + e_i / 2)`` with ``v`` the optimizer's velocity and
  ``e_i`` its gradient
  of the step before plus its residual (zero at step 0), cut to its 2 (= round(0.3 n))
  largest entries where the sync it goes to is sparse (after the two syncs of the dense
  warm-up); the parameters stay replicated and are the plain delayed chain's when it is fed
  the same gradients."""
  p, n, steps, warmup = 4, 6, 6, 2
  data = problem(np.random.default_rng(1), p, n, same=False)
  sync = dict(density=0.3, delay=1, warmup_steps=warmup)
  tx = sj.weight_prediction(sj.spardl(**sync), optax.sgd(LR, momentum=M), scale=0.5)
  v, last_grads = np.zeros(n), np.zeros((p, n))
  params = {"w": jnp.zeros(n)}
  plain = optax.chain(sj.spardl(**sync), optax.sgd(LR, momentum=M))
  plain_state = sj.init_opt_state(plain, params, harness.mesh(p))
  plain_update = harness.update_fn(plain, p, params)
  for t, (before, points, after) in enumerate(run(tx, p, params, data, quadratic, steps)):
    x = before["w"].astype(np.float64)
    residuals = np.asarray(plain_state[0].method_state.residual, np.float64)
    estimate = last_grads + residuals
    if t - 1 >= warmup:  # the held message goes to sync t - 1, a sparse one
      estimate = np.stack([largest(e, 2) for e in estimate])
    np.testing.assert_allclose(points["w"], x - LR * (M * v + 0.5 * estimate), rtol=1e-5,
                               atol=1e-5)
    grads = np.stack([data[i, :-1] @ (points["w"][i] - data[i, -1]) for i in range(p)])
    updates, plain_state = plain_update(harness.put_rows(p, {"w": jnp.asarray(grads)}),
                                        plain_state)
    np.testing.assert_allclose(after["w"], x + np.asarray(updates["w"]), rtol=1e-5, atol=1e-6)
    v = (x - after["w"]) / LR  # sgd: params -= lr * v_new
    last_grads = grads


def test_lookahead_params_leaves_other_transformations_alone():
  params = {"w": jnp.ones(3)}
  tx = optax.chain(sj.spardl(delay=1), optax.sgd(LR))
  assert sj.points.predicted_params(tx, None, params) is params


@pytest.mark.parametrize("build,match", [
    (lambda: sj.weight_prediction(sj.spardl(), optax.sgd(LR)), "delay=1"),
    (lambda: sj.weight_prediction(optax.sgd(LR), optax.sgd(LR)), "delay=1"),
    (lambda: sj.weight_prediction(sj.spardl(delay=1)), "transformations after the sync"),
    (lambda: sj.weight_prediction(sj.spardl(delay=1), optax.sgd(LR), scale=1.5),
     r"scale must be in \[0, 1\], got 1.5"),
    (lambda: sj.weight_prediction(sj.spardl(delay=1, axis_name="host", local_axis="local"),
                          optax.sgd(LR)), "local_axis"),
])
def test_bad_input(build, match):
  with pytest.raises(ValueError, match=match):
    build()


def _points_and_counts(tx, p, params, batches, loss):
  """Each step's parameters before it, every device's point and the sync's count of skipped
  steps after it, for a batch per step (``batches[t]`` the devices' rows)."""
  mesh = harness.mesh(p)
  specs = sj.opt_state_specs(tx, params, mesh)

  def step(params, state, batch):
    point = sj.points.predicted_params(tx, state, params)
    grads = jax.grad(loss)(jax.lax.pcast(point, AXIS, to="varying"), batch[0])
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, point["w"][None]

  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P(AXIS)),
                            out_specs=(P(), specs, P(AXIS)), check_vma=False))
  state = sj.init_opt_state(tx, params, mesh)
  for batch in batches:
    params, state, points = f(params, state, harness.put_rows(p, jnp.asarray(batch)))
    yield np.asarray(points), int(np.asarray(sj.sync_stats(state[0]).nonfinite)[0])


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_held_nan_skips_one_step_and_the_estimate_stays_finite(optimizer):
  """A NaN in device 0's batch at step 2 only, clean batches after: the sync skips one step
  (the one that sends it), every later point is finite on every device, and with a dense
  sync and every device on the same quadratic the points are the NumPy model's: each device
  looks ahead by its held message, or by nothing where it holds a non-finite one, and the
  skipped step delivers zeros to the optimizer."""
  p, n, steps, bad = 4, 6, 7, 2
  data = problem(np.random.default_rng(3), p, n, same=True)
  batches = [data.copy() for _ in range(steps)]
  batches[bad][0, :-1] = np.nan
  after = optax.sgd(LR, momentum=M) if optimizer == "sgd" else optax.adam(0.05)
  tx = sj.weight_prediction(sj.sync_gradients("dense", delay=1), after)
  got = list(_points_and_counts(tx, p, {"w": jnp.zeros(n)}, batches, quadratic))
  assert [count for _, count in got] == [0, 0, 0, 1, 1, 1, 1]
  assert all(np.isfinite(points).all() for points, _ in got[bad + 1:])
  if optimizer == "adam":
    return
  a, c = data[0, :-1].astype(np.float64), data[0, -1].astype(np.float64)
  x, v = np.zeros(n), np.zeros(n)
  held, ok = np.zeros((p, n)), False
  for t, batch in enumerate(batches):
    estimate = np.where(np.isfinite(held).all(1, keepdims=True) & ok, held, 0.0)
    points = x - LR * (M * v + estimate)
    if t > bad:  # finite again from the step after the NaN
      np.testing.assert_allclose(got[t][0], points, rtol=1e-4, atol=1e-4)
    grads = (points - c) @ a.T
    grads[~np.isfinite(batch[:, :-1]).all((1, 2))] = np.nan
    delivered = held.mean(0) if ok and np.isfinite(held).all() else np.zeros(n)
    v = delivered + M * v
    x = x - LR * v
    held, ok = grads, True
