"""`sj.checkpoint.refold`: a state saved on P devices restored onto P' from a user's own loop.
Held to independent answers: the residuals' total in float64 (conservation), a MultiSteps
accumulator's mean, a sharded run's per-column mass, the step count kept, Orbax round trips
from 8 devices to 4 and 2 and from 2 to 8, and training that goes on after the restore."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import spardl_jax as sj
from spardl_jax._src.baselines.common import ResidualState
from tests import harness

AXIS = harness.AXIS


def test_fold_rules_conserve_mass_and_means():
  """Residual rows keep their total; MultiSteps accumulators keep their mean; a sharded
  run's columns each keep their own residual mass."""
  rng = np.random.default_rng(0)
  saved = (rng.standard_normal((8, 1000)) * 10 ** rng.uniform(-3, 3, 1000)).astype(np.float32)
  for devices in (1, 3, 4, 6, 16):
    rows = sj.checkpoint.fold_sum(saved, devices)
    assert rows.shape == (devices, 1000) and rows.dtype == np.float32
    total = saved.astype(np.float64).sum(0)
    np.testing.assert_allclose(rows.astype(np.float64).sum(0), total, rtol=0,
                               atol=1e-6 * np.abs(saved).max())
    assert devices == 1 or np.ptp(rows[:-1], axis=0).max() == 0  # evenly spread
  # A MultiSteps accumulator (rule MEAN) saved on 8 devices, 3 rows each, restored onto 4.
  params = {"w": jnp.zeros((5,))}
  tx = optax.MultiSteps(optax.chain(sj.spardl(density=0.5), optax.sgd(0.1)), 3)
  like = sj.init_opt_state(tx, params, harness.mesh(4))
  saved_state = jax.tree.map(np.asarray, sj.init_opt_state(tx, params, harness.mesh(8)))
  acc = rng.standard_normal(saved_state.acc_grads["w"].shape).astype(np.float32)
  saved_state = saved_state._replace(acc_grads={"w": acc})
  rows = np.asarray(sj.checkpoint.refold(saved_state, like).acc_grads["w"])
  np.testing.assert_allclose(rows.reshape(4, -1, 5).mean(0), acc.reshape(8, -1, 5).mean(0),
                             rtol=1e-6)
  # A sharded run's rows (data-major, 2 columns of the "model" axis) saved on data = 4 and
  # restored on data = 2: each column keeps its own residual mass.
  mesh2 = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
  like = ResidualState(jax.device_put(jnp.zeros((4, 7)),
                                      NamedSharding(mesh2, P(("data", "model")))))
  saved = rng.standard_normal((8, 7)).astype(np.float32)
  rows = np.asarray(sj.checkpoint.refold(ResidualState(saved), like).residual)
  np.testing.assert_allclose(rows.reshape(2, 2, 7).sum(0), saved.reshape(4, 2, 7).sum(0),
                             rtol=1e-5, atol=1e-6)
  mesh8 = jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices()[:8])
  saved_there = jax.device_put(saved, NamedSharding(mesh8, P(("data", "model"))))
  with pytest.raises(sj.checkpoint.RefoldError, match="residual was saved with 4 devices "
                                                      "on the mesh axes besides the data"):
    sj.checkpoint.refold(ResidualState(saved_there), like)
  # The rules come from the state types: what each leaf of a real optimizer state gets.
  params = {"w": jnp.zeros((40,))}
  tx = optax.MultiSteps(optax.chain(sj.spardl(density=0.1, momentum=0.9), optax.sgd(0.1)), 2)
  rules = sj.checkpoint.fold_rules(sj.init_opt_state(tx, params, harness.mesh(4)))
  sync = rules.inner_opt_state[0]
  assert (sync.method_state.residual, sync.velocity, sync.count) == ("sum", "sum", "same")
  assert set(jax.tree.leaves((sync.method_state.controller, sync.stats))) == {"fresh"}
  assert rules.acc_grads == {"w": "mean"} and rules.mini_step == "fresh"


PARAMS = {"w": jnp.zeros((48, 16)), "b": jnp.zeros(16)}


def _train(tx, p, state, steps, seed):
  """``steps`` updates on P devices of fixed random local gradients; the new state."""
  mesh = harness.mesh(p)
  specs = sj.opt_state_specs(tx, PARAMS, mesh)
  f = jax.jit(jax.shard_map(
      lambda g, s: tx.update(jax.tree.map(lambda a: a[0], g), s, PARAMS), mesh=mesh,
      in_specs=(P(AXIS), specs), out_specs=(P(), specs), check_vma=False))
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    grads = harness.put_rows(p, {k: rng.normal(size=(p, *v.shape)).astype(np.float32)
                                 for k, v in PARAMS.items()})
    _, state = f(grads, state)
  return state


def _orbax_round_trip(tmp_path, state, like):
  """``state`` saved with Orbax and restored onto ``like``'s devices as the docs show."""
  ckptr = ocp.StandardCheckpointer()
  path = tmp_path / f"state{len(list(tmp_path.iterdir()))}"
  ckptr.save(path, state)
  ckptr.wait_until_finished()
  saved = ckptr.restore(path, sj.checkpoint.as_saved(ckptr.metadata(path), like))
  return sj.checkpoint.refold(saved, like, metadata=ckptr.metadata(path))


def test_an_orbax_checkpoint_of_a_users_loop_restores_onto_another_device_count(tmp_path):
  """Saved on 8 devices, restored onto 4 and 2; saved on 2, restored onto 8 (the program of
  docs/data-parallel.md runs 8 -> 4 with training after). The residual's total is kept
  (float64), the step count goes on, and the restored state trains."""
  tx = optax.chain(sj.spardl(density=0.05, warmup_steps=1), optax.sgd(0.1, momentum=0.9))
  state = _train(tx, 8, sj.init_opt_state(tx, PARAMS, harness.mesh(8)), 3, 0)
  for saved_on, restored_on in ((8, 4), (8, 2), (2, 8)):
    total = np.asarray(state[0].method_state.residual).astype(np.float64).sum(0)
    assert np.abs(total).max() > 0
    like = sj.init_opt_state(tx, PARAMS, harness.mesh(restored_on))
    restored = _orbax_round_trip(tmp_path, state, like)
    residual = np.asarray(restored[0].method_state.residual)
    assert residual.shape == (restored_on, total.size), (saved_on, restored_on)
    np.testing.assert_allclose(residual.astype(np.float64).sum(0), total, rtol=0,
                               atol=1e-6 * np.abs(total).max())
    np.testing.assert_array_equal(restored[0].count, np.asarray(state[0].count)[0])
    assert restored[0].method_state.residual.sharding == like[0].method_state.residual.sharding
    if restored_on == 2:  # training goes on from the restored state; it is saved next
      state = _train(tx, 2, restored, 2, 1)
      np.testing.assert_array_equal(state[0].count, 5)
      assert np.isfinite(np.asarray(state[0].method_state.residual)).all()


def test_a_state_that_cannot_be_folded_is_refused_in_one_line():
  """Another structure, another model size, another dtype: RefoldError names the leaf, and
  nothing is built."""
  tx = optax.chain(sj.spardl(density=0.05), optax.sgd(0.1))
  like = sj.init_opt_state(tx, PARAMS, harness.mesh(4))
  other = sj.init_opt_state(tx, {"w": jnp.zeros((10, 16)), "b": jnp.zeros(16)},
                            harness.mesh(8))
  with pytest.raises(sj.checkpoint.RefoldError, match="residual has shape .* only a per-device"):
    sj.checkpoint.refold(other, like)
  adam = sj.init_opt_state(optax.chain(sj.spardl(density=0.05), optax.adam(0.1)), PARAMS,
                           harness.mesh(8))
  with pytest.raises(sj.checkpoint.RefoldError, match="only on one side"):
    sj.checkpoint.refold(adam, like)
  half = jax.tree.map(lambda a: np.asarray(a).astype(np.float16)
                      if np.asarray(a).dtype == np.float32 else np.asarray(a),
                      sj.init_opt_state(tx, PARAMS, harness.mesh(8)))
  with pytest.raises(sj.checkpoint.RefoldError, match="saved as float16 and is float32"):
    sj.checkpoint.refold(half, like)


def test_refold_refuses_what_it_cannot_fold_whole():
  """A residual holding a NaN, and a residual of 7 rows beside per-device leaves of 8: each
  refused by name before anything is built (accepted, the first would skip every sync after
  the restore and the second fold 7 devices' books as if 7 had run)."""
  tx = optax.chain(sj.spardl(density=0.05), optax.sgd(0.1, momentum=0.9))
  state = jax.device_get(_train(tx, 8, sj.init_opt_state(tx, PARAMS, harness.mesh(8)), 2, 0))
  like = sj.init_opt_state(tx, PARAMS, harness.mesh(4))
  residual = np.asarray(state[0].method_state.residual).copy()
  residual[3, 5] = np.nan
  poisoned = (state[0]._replace(method_state=state[0].method_state._replace(
      residual=residual)), state[1])
  with pytest.raises(sj.checkpoint.RefoldError, match=r"method_state/residual holds 1 non-"):
    sj.checkpoint.refold(poisoned, like)
  cut = (state[0]._replace(method_state=state[0].method_state._replace(
      residual=np.asarray(state[0].method_state.residual)[:7])), state[1])
  with pytest.raises(sj.checkpoint.RefoldError, match=r"disagree on the devices .*residual: 7"):
    sj.checkpoint.refold(cut, sj.init_opt_state(tx, PARAMS, harness.mesh(8)))


def test_a_state_cut_onto_another_device_count_is_refused_at_its_first_update(tmp_path):
  """Saved on 8 devices, restored onto 4 as Orbax's own error advises (``strict=False``: each
  leaf cut to the target's rows, half the residual's mass gone): the first update refuses it
  with the library's line naming the refold, before any collective; refolded, it trains."""
  tx = optax.chain(sj.spardl(density=0.05), optax.sgd(0.1, momentum=0.9))
  state = _train(tx, 8, sj.init_opt_state(tx, PARAMS, harness.mesh(8)), 2, 0)
  like = sj.init_opt_state(tx, PARAMS, harness.mesh(4))
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(tmp_path / "s", state)
  ckptr.wait_until_finished()
  cut = ckptr.restore(tmp_path / "s", like, strict=False)
  assert np.asarray(cut[0].method_state.residual).shape == (4, 48 * 16 + 16)  # strict=False
  with pytest.raises(Exception, match=r"laid out for 8 devices and this step runs on 4.*"
                                      r"sj\.checkpoint\.refold"):
    jax.block_until_ready(_train(tx, 4, cut, 1, 0))
  saved = ckptr.restore(tmp_path / "s", sj.checkpoint.as_saved(ckptr.metadata(tmp_path / "s"),
                                                                like))
  trained = _train(tx, 4, sj.checkpoint.refold(saved, like), 1, 0)
  assert np.isfinite(np.asarray(trained[0].method_state.residual)).all()
