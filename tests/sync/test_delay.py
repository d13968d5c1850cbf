"""The delayed sync (``delay=1``): the NumPy models fed one step late, conservation with the
held message, a skipped step, the fold of the held message, the Adam recipe and the outer
loop with it, bad input, and the compiled train step's collectives free of the batch."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spardl_jax as sj
from spardl_jax._src.sync import delay
from tests import harness
from tests.sync import test_adam, test_convergence_options as options_test, test_outer

N = options_test.N


def synced(tx, grads, p):
  """Each step's (y, residuals, state) of ``tx`` fed the (P, N) gradients ``grads``."""
  params = {"w": jnp.zeros((N,))}
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  f = harness.update_fn(tx, p, params)
  for g in grads:
    updates, state = f(harness.put_rows(p, {"w": jnp.asarray(g)}), state)
    sync = options_test.the_sync(state)
    yield np.asarray(updates["w"]), np.asarray(sync.method_state.residual), sync


CASES = {
    "plain": dict(density=0.05),
    "warm-up and schedule": dict(density=[(0, 0.2), (3, 0.05)], warmup_steps=1),
    "momentum correction": dict(density=0.05, momentum=0.9),
    "clipping and decay": dict(density=0.05, clip=2.0, residual_decay=0.8),
}


@pytest.mark.parametrize("name", CASES)
def test_each_step_delivers_the_models_sync_of_the_step_before(name):
  """Step 0 delivers zeros and leaves the residual empty; step t delivers the NumPy model's
  sync of step t - 1 with the model's residual after it, and holds step t's gradient."""
  p, opts = 5, dict(CASES[name])
  clip = opts.pop("clip", None)
  grads = options_test.rows(np.random.default_rng(7), p, 5)
  model = list(options_test.model(
      grads, p=p, density=opts["density"], warmup=opts.get("warmup_steps", 0),
      momentum=opts.get("momentum"), clip=clip, decay=opts.get("residual_decay")))
  got = list(synced(options_test.with_local_clipping(sj.spardl(delay=1, **opts), clip, p),
                    grads, p))
  np.testing.assert_array_equal(got[0][0], 0)
  np.testing.assert_array_equal(got[0][1], 0)
  for t, (y, rs, state) in enumerate(got):
    if clip is None:
      np.testing.assert_array_equal(np.asarray(state.pending.message), grads[t])
    else:  # optax's clip before the sync, against the model's in float64
      np.testing.assert_allclose(np.asarray(state.pending.message),
                                 options_test.clipped(grads[t], clip, p), rtol=1e-6, atol=1e-7)
    assert np.asarray(state.pending.held).all() and np.asarray(state.count)[0] == t
    if t:
      np.testing.assert_allclose(y, model[t - 1][0], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(rs, model[t - 1][1], rtol=1e-5, atol=1e-5)


def test_residuals_held_messages_and_deliveries_account_for_every_gradient():
  """sum(residuals) + sum(held messages) + P * sum(delivered) == sum(gradients fed), after
  every step, in float64 (the plain option, where nothing is clipped or decayed)."""
  p = 8
  grads = options_test.rows(np.random.default_rng(3), p, 5)
  fed, delivered = np.zeros(N), np.zeros(N)
  for g, (y, rs, state) in zip(grads, synced(sj.spardl(density=0.05, delay=1), grads, p)):
    fed += g.astype(np.float64).sum(0)
    delivered += p * y.astype(np.float64)
    held = np.asarray(state.pending.message, np.float64).sum(0)
    total = rs.astype(np.float64).sum(0) + held + delivered
    np.testing.assert_array_less(np.abs(total - fed), 1e-4 * (np.abs(fed) + 1))


def test_a_nonfinite_gradient_is_skipped_one_step_later():
  """A NaN in step 1's gradient: step 1 delivers step 0's sync, step 2 delivers zeros and
  counts the skip with the residual unchanged, step 3 delivers the model's sync of step 2
  on the residual step 0 left: the NaN step is dropped, nothing else."""
  p = 4
  grads = options_test.rows(np.random.default_rng(5), p, 4)
  grads[1] = grads[1].copy()
  grads[1][2, 7] = np.nan
  got = list(synced(sj.spardl(density=0.05, delay=1), grads, p))
  model = list(options_test.model([grads[0], grads[2]], p=p, density=0.05))
  np.testing.assert_allclose(got[1][0], model[0][0], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got[2][0], 0)
  np.testing.assert_array_equal(got[2][1], got[1][1])
  assert np.asarray(got[2][2].stats.nonfinite)[0] == 1
  np.testing.assert_allclose(got[3][0], model[1][0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got[3][1], model[1][1], rtol=1e-5, atol=1e-5)


def test_the_held_message_folds_to_the_devices_mean():
  """On a restore onto fewer devices every new device holds the mean message, so the next
  dense sync delivers the mean gradient the old devices would have; the flag is kept."""
  p = 8
  grads = options_test.rows(np.random.default_rng(2), p, 2)
  tx = sj.spardl(density=1.0, delay=1, wire="exact")
  *_, (_, _, state) = synced(tx, grads, p)
  rules = sj.checkpoint.fold_rules(state)
  assert (rules.pending.message, rules.pending.held) == ("mean", "same")
  like = sj.init_opt_state(tx, {"w": jnp.zeros((N,))}, harness.mesh(4))
  folded = sj.checkpoint.refold(jax.device_get(state), like)
  np.testing.assert_allclose(np.asarray(folded.pending.message),
                             np.broadcast_to(grads[1].mean(0), (4, N)), rtol=1e-6, atol=1e-6)
  assert np.asarray(folded.pending.held).all()
  f = harness.update_fn(tx, 4, {"w": jnp.zeros((N,))})
  y, _ = f(harness.put_rows(4, {"w": jnp.zeros((4, N))}), folded)
  np.testing.assert_allclose(np.asarray(y["w"]), grads[1].mean(0), rtol=1e-5, atol=1e-6)


def test_synced_adam_with_a_delayed_sync_is_its_numpy_model_one_step_later():
  """The Adam recipe's momentum through a delayed sync: the first step applies nothing and
  counts nothing; step t applies the NumPy model's step t - 1 (warm-up, v trained where the
  sync delivers, SparDL at 20 % with its residual)."""
  p, n, b1, b2, eps, lr, wd = 4, 60, 0.9, 0.99, 1e-8, 0.1, 0.01
  rng = np.random.default_rng(4)
  grads = [harness.gradients(rng, p, n) for _ in range(6)]
  params = {"w": jnp.asarray(rng.standard_normal(n), jnp.float32)}
  tx = sj.synced_adamw(lr, warmup_steps=2, density=0.2, wire="exact", b1=b1, b2=b2, eps=eps,
                       weight_decay=wd, delay=1, dense_leaves=None)
  state = sj.init_opt_state(tx, params, harness.mesh(p))
  f = harness.update_fn(tx, p, params)
  want = test_adam.numpy_synced_adam(grads, warmup=2, freeze_step=2, density=0.2, b1=b1,
                                     b2=b2, eps=eps, second_moment="sent")
  decay = -lr * wd * np.asarray(params["w"])
  out, state = f(harness.put_rows(p, {"w": jnp.asarray(grads[0])}), state)
  np.testing.assert_allclose(np.asarray(out["w"]), decay, rtol=1e-6)  # weight decay only
  assert int(state[0].count) == 0
  for g, (want_adam, want_rs) in zip(grads[1:], want):
    out, state = f(harness.put_rows(p, {"w": jnp.asarray(g)}), state)
    np.testing.assert_allclose(np.asarray(out["w"]), -lr * want_adam + decay, rtol=2e-4,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(state[0].sync.method_state.residual), want_rs,
                               rtol=1e-5, atol=1e-6)


def test_an_outer_loop_applies_each_rounds_mean_one_round_later():
  """DiLoCo with a delayed dense outer sync equals the NumPy DiLoCo whose sync returns the
  round before's mean pseudo-gradient (zeros after the first round)."""
  p, every, lr = 4, 2, 0.05
  batches = test_outer.batches_for(np.random.default_rng(1), p, 3 * every)
  held = [None]

  def late_mean(pseudo):
    mean, held[0] = (np.zeros(pseudo.shape[1:], np.float32) if held[0] is None
                     else held[0]), pseudo.mean(axis=0)
    return mean

  tx = sj.diloco(optax.sgd(lr, momentum=0.9), sj.sync_gradients("dense", delay=1),
                 every=every)
  got, _ = test_outer.train(tx, p, batches)
  want = test_outer.numpy_diloco(np.zeros(test_outer.N, np.float32), batches, every=every,
                                 lr=lr, momentum=0.9, outer_lr=0.7, outer_momentum=0.9,
                                 sync=late_mean)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("delay", [2, -1, True, "1", 0.5])
def test_a_bad_delay_is_named(delay):
  with pytest.raises(ValueError, match=r"delay must be 0 .* or 1 .*got"):
    sj.spardl(delay=delay)


def test_what_a_delayed_sync_cannot_take_is_named():
  with pytest.raises(ValueError, match="sends='preconditioned' with a delayed sync"):
    sj.synced_adamw(1e-3, warmup_steps=2, sends="preconditioned", delay=1)
  p, params, mesh = 4, {"w": jnp.zeros((N,))}, harness.mesh(4)
  undelayed = sj.init_opt_state(sj.spardl(), params, mesh)

  def update(tx, **extra):  # a shard_map laid out for the state given
    return jax.jit(jax.shard_map(
        lambda g, s: tx.update(jax.tree.map(lambda a: a[0], g), s, **extra), mesh=mesh,
        in_specs=(jax.P(harness.AXIS), sj.opt_state_specs(sj.spardl(), params, mesh)),
        out_specs=jax.P(), check_vma=False))

  grads = harness.put_rows(p, {"w": jnp.zeros((p, N))})
  with pytest.raises(ValueError, match="initialized with another delay"):
    update(sj.spardl(delay=1))(grads, undelayed)
  with pytest.raises(ValueError, match="next_message, which only a delayed sync"):
    update(sj.spardl(), next_message=lambda m, g: m)(grads, undelayed)


# The compiled program's text: each instruction's name, opcode, and every %name on its line
# (its operands and the computations it calls).
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([\w\-]+)\((.*)$")
COLLECTIVES = ("all-reduce", "all-gather", "collective-permute", "reduce-scatter",
               "all-to-all", "collective-broadcast")


def collectives_reached_from(text: str, sources) -> tuple[int, list[str]]:
  """``(collectives, the result types of those whose inputs may depend on a parameter of the
  entry computation whose type starts with one of sources)``. A called computation's instructions depend on
  whatever any of its callers' operands does (an over-approximation: it may report a
  dependence that is not there, never miss one)."""
  computations: dict[str, list] = {}
  entry, current = None, None
  for line in text.splitlines():
    head = _COMPUTATION.match(line)
    if head:
      current = head.group(2)
      computations[current] = []
      entry = current if head.group(1) else entry
      continue
    instr = _INSTRUCTION.match(line)
    if instr and current is not None:
      name, kind, op, rest = instr.groups()
      computations[current].append((name, kind, op, re.findall(r"%([\w.\-]+)", rest)))
  tainted_computations: set[str] = set()
  tainted: set[str] = set()
  changed = True
  while changed:  # to a fixed point: a computation is tainted by any tainted caller
    changed = False
    for comp, instrs in computations.items():
      for name, kind, op, refs in instrs:
        hit = ((comp == entry and op == "parameter" and kind.startswith(tuple(sources)))
               or (comp in tainted_computations and op == "parameter")
               or any(r in tainted for r in refs if r not in computations))
        if hit and name not in tainted:
          tainted.add(name)
          changed = True
        for called in (r for r in refs if r in computations):
          if hit and called not in tainted_computations:
            tainted_computations.add(called)
            changed = True
  found = [(name, f"{op} {kind}") for instrs in computations.values()
           for name, kind, op, _ in instrs if op.removesuffix("-start") in COLLECTIVES]
  return len(found), [what for name, what in found if name in tainted]


def _waiting_collectives(delay):
  """The collectives of the compiled data-parallel step (forward, backward, SparDL, SGD)
  whose inputs may depend on the batch: ``(all, waiting)``."""
  p = 8
  mesh = harness.mesh(p)
  params = {"w": jnp.zeros((11, 7)), "b": jnp.zeros((7,))}
  x, y = jnp.ones((p * 5, 11)), jnp.ones((p * 5, 7))

  def loss(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2)

  tx = optax.chain(sj.spardl(density=0.1, delay=delay), optax.sgd(0.1))
  step = sj.data_parallel_step(loss, tx, mesh)
  state = sj.init_opt_state(tx, params, mesh)
  text = step.lower(params, state, x, y).compile().as_text()
  return collectives_reached_from(text, ("f32[5,11]", "f32[5,7]"))


def test_no_collective_of_a_delayed_train_step_waits_for_its_batch(monkeypatch):
  """On a runtime that runs every device's collectives in the compiled order (GPUs, TPUs:
  the sync built as there, compiled here for its HLO), no collective of the delayed sync can
  depend on the batch, only the scalar all-reduce of the loss the step reports; without the
  delay, the sync's collective-permutes do."""
  monkeypatch.setattr(delay, "UNORDERED_COLLECTIVES", ())
  total, waiting = _waiting_collectives(1)
  assert total > 1 and waiting == ["all-reduce f32[]"], (total, waiting)
  # The check sees a dependence where there is one.
  assert any(what.startswith("collective-permute") for what in _waiting_collectives(0)[1])


def test_on_the_cpu_a_delayed_sync_waits_for_the_gradient():
  """XLA:CPU may start a step's independent collectives in another order on each device (a
  hang, seen): there the delayed sync's permutes wait for the batch's gradient, as the
  undelayed sync's do, and every collective keeps the undelayed order."""
  assert jax.default_backend() == "cpu" and delay.waits_for_gradient()
  assert sorted(_waiting_collectives(1)[1]) == sorted(_waiting_collectives(0)[1])
