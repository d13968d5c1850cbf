"""`sync_gradients(balance="leaves")`: each leaf is scaled by the power of two nearest to the
vector's root mean square over its own (over every device's gradient) before SparDL selects,
and scaled back after: the synced result and the residual are the NumPy model's SparDL on
the scaled vector, scaled back; the books stay exact in the gradient's units; a leaf of
small gradients gets its share of entries (none without); a non-finite step keeps the
residual; the bytes are the compiled HLO's (SparDL's plus one all-reduce of two numbers a
leaf); on meshes of several axes each entry is scaled by its own leaf's power."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import spardl_jax as sj
from spardl_jax._src.sync.packing import Packing
from spardl_jax.tools import traffic
from tests import formulas, harness, reference
from tests.sync.test_lookahead import run

# Leaves whose gradients differ in size by up to 2**12: one top-k over the whole vector
# would take nothing from "tiny".
SIZES = {"big": 8.0, "tiny": 2.0 ** -9, "w": 1.0}
PARAMS = {"big": jnp.zeros((6, 5), jnp.float32), "tiny": jnp.zeros((40,), jnp.float32),
          "w": jnp.zeros((12, 10), jnp.float32)}
DENSITY = 0.1


def grads_of(rng, p):
  return {k: jnp.asarray(SIZES[k] * rng.standard_normal((p, *v.shape)), v.dtype)
          for k, v in PARAMS.items()}


def numpy_scales(flat_rows, sizes):
  """The powers of two of each leaf, written from docs/design.md: 2**round(log2(rms of the
  vector / rms of the leaf)) over every device's entries, in float64."""
  bounds = np.cumsum([0, *sizes])
  squares = np.square(flat_rows.astype(np.float64))
  overall = squares.mean()
  exps = [np.round(0.5 * np.log2(overall / squares[:, a:b].mean()))
          for a, b in zip(bounds[:-1], bounds[1:])]
  return np.concatenate([np.full(s, 2.0 ** e) for s, e in zip(sizes, exps)]).astype(np.float32)


def test_each_leaf_is_scaled_before_spardl_and_back_after():
  p = 4
  tx = sj.spardl(density=DENSITY, balance="leaves", wire="exact")
  state = sj.init_opt_state(tx, PARAMS, harness.mesh(p))
  f = harness.update_fn(tx, p, PARAMS)
  rng = np.random.default_rng(0)
  keys = sorted(PARAMS)  # tree order
  sizes = [PARAMS[k].size for k in keys]
  rs = np.zeros((p, sum(sizes)), np.float32)
  for _ in range(3):
    grads = grads_of(rng, p)
    updates, state = f(harness.put_rows(p, grads), state)
    flat = harness.flat_rows(grads, keys, p)
    s = numpy_scales(flat, sizes)
    y, new_rs = reference.spardl(flat * s, rs * s, DENSITY)
    harness.assert_synced(updates, np.asarray(state.method_state.residual), keys,
                          (y / s, new_rs / s), (flat, rs), atol=(1e-12, 1e-12))
    rs = new_rs / s
  assert np.count_nonzero(updates["tiny"]) > 0


def test_without_it_the_small_leaf_gets_nothing():
  """The test above's case is one where balancing matters: the same gradients unbalanced
  leave "tiny" out of every selection."""
  p = 4
  tx = sj.spardl(density=DENSITY, wire="exact")
  state = sj.init_opt_state(tx, PARAMS, harness.mesh(p))
  f = harness.update_fn(tx, p, PARAMS)
  rng = np.random.default_rng(0)
  for _ in range(3):
    updates, state = f(harness.put_rows(p, grads_of(rng, p)), state)
    assert np.count_nonzero(updates["tiny"]) == 0


def test_a_nonfinite_step_keeps_the_residual_and_stats_bytes_are_the_compiled_traffic():
  p = 4
  tx = optax.chain(sj.spardl(density=DENSITY, balance="leaves", wire="exact"), optax.sgd(0.1))
  state = sj.init_opt_state(tx, PARAMS, harness.mesh(p))
  f = harness.update_fn(tx, p, PARAMS)
  rng = np.random.default_rng(1)
  grads = harness.put_rows(p, grads_of(rng, p))
  _, state = f(grads, state)
  before = np.asarray(state[0].method_state.residual)
  bad = grads_of(rng, p)
  bad["w"] = bad["w"].at[1, 2, 3].set(jnp.inf)
  updates, state = f(harness.put_rows(p, bad), state)
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  np.testing.assert_array_equal(np.asarray(state[0].method_state.residual), before)
  hlo = traffic.parse_hlo(f.lower(grads, state).compile().as_text())
  n = sum(v.size for v in PARAMS.values())
  assert hlo.bytes_sent(0) == formulas.spardl(p, n, DENSITY)["bytes"]
  # The scales' all-reduce: two numbers for each of the three leaves.
  reduced = sorted(c.elements for c in hlo.others if c.op.startswith("all-reduce"))
  assert 6 in reduced
  stats = sj.sync_stats(state[0])
  np.testing.assert_array_equal(np.asarray(stats.bytes_sent)[0], hlo.bytes_sent(0)
                                + formulas.dense(p, 6)["bytes"])


def test_with_synced_adamw_every_leaf_moves():
  p = 4
  tx = sj.synced_adamw(1e-2, warmup_steps=1, density=DENSITY, balance="leaves")
  state = sj.init_opt_state(tx, PARAMS, harness.mesh(p))
  f = harness.update_fn(tx, p, PARAMS)
  rng = np.random.default_rng(3)
  for _ in range(3):  # past the dense warm-up
    updates, state = f(harness.put_rows(p, grads_of(rng, p)), state)
  assert np.count_nonzero(updates["tiny"]) > 0


def test_a_look_ahead_ranks_its_estimate_as_the_balanced_sync_will():
  """A delayed balanced sync looked ahead by 1 under SGD at rate 1, on a linear loss whose
  gradient is each device's batch row: at step 1 device i's point is minus its held
  gradient cut to the round(0.25 * 12) = 3 entries largest once scaled leaf by leaf (the
  scales from every device's gradient, as the sync computes them); at step 2 the estimate
  adds the residual the sync of step 1 left (NumPy's SparDL), still ranked with the scales
  of the held gradient alone, and the point starts from step 1's update."""
  p, k = 4, 3
  params = {"a": jnp.zeros(6), "b": jnp.zeros(6)}
  rng = np.random.default_rng(4)
  data = (rng.standard_normal((p, 12)) * np.repeat([1.0, 2.0 ** -6], 6)).astype(np.float32)
  tx = sj.weight_prediction(sj.spardl(density=0.25, delay=1, balance="leaves", wire="exact"),
                    optax.sgd(1.0), scale=1.0)

  def linear(params, batch):
    return jnp.concatenate([params["a"], params["b"]]) @ batch

  steps = list(run(tx, p, params, data, linear, 3))
  s = numpy_scales(data, [6, 6])
  y, residuals = reference.spardl(data * s, np.zeros_like(data), 0.25)
  y, residuals = y / s, residuals / s  # the sync at step 1, of step 0's gradient
  for t, owed, start in ((1, np.zeros_like(data), 0.0), (2, residuals, -y)):
    points = np.concatenate([steps[t][1]["a"], steps[t][1]["b"]], axis=1)
    estimate = data + owed
    ranked = np.abs(estimate * s)
    for i in range(p):
      expected = np.zeros(12, np.float32)
      keep = np.argsort(-ranked[i], kind="stable")[:k]
      expected[keep] = estimate[i, keep]
      np.testing.assert_allclose(points[i], start - expected, rtol=1e-5, atol=1e-7)
    assert np.count_nonzero(points[:, 6:]) > 0  # the small leaf is in the estimate


@pytest.mark.parametrize("mesh_shape, local", [((2, 2, 2), None), ((2, 4), "local")])
def test_every_entry_is_scaled_by_its_own_leaf_on_any_mesh(mesh_shape, local):
  """`Packing.leaf_ids` against the flat vector of leaves filled with their index + 1
  (padding 0), on a mesh where leaves are sharded, replicated and sliced over a model axis,
  and on a (host, local) mesh where each device syncs a slice of the host's vector."""
  names = ("data", "model", "x")[:len(mesh_shape)] if local is None else ("data", local)
  mesh = jax.make_mesh(mesh_shape, names, devices=jax.devices()[:int(np.prod(mesh_shape))])
  shapes = [(8, 6), (5,), (3, 7), (11,)]
  specs = ([P(None, "model"), P(), P(None, "x"), P()] if local is None else [P()] * 4)
  others = {} if local is not None else {"model": 2, "x": 2}

  def local_shapes():
    return [tuple(d // (mesh.shape[spec[i]] if i < len(spec) and spec[i] else 1)
                  for i, d in enumerate(shape)) for shape, spec in zip(shapes, specs)]

  def body():
    layout = Packing.build(local_shapes(), specs, others, local)
    sizes = [int(np.prod(s)) for s in local_shapes()]
    ids = layout.leaf_ids(sizes)
    filled = layout.flatten([jnp.full(s, i + 1.0) for i, s in enumerate(local_shapes())],
                            jnp.float32)
    return ids[None], filled[None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(), out_specs=P(names),
                            check_vma=False))
  ids, filled = (np.asarray(a) for a in f())
  expected = np.where(filled == 0, len(shapes), filled - 1)
  np.testing.assert_array_equal(ids, expected)
  assert set(np.unique(ids)) - {len(shapes)} == set(range(len(shapes)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(balance="chunks"), r"balance must be None .* or 'leaves'"),
    (dict(balance=True), r"balance must be None"),
])
def test_bad_balance_is_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sj.spardl(density=0.1, **kwargs)


def test_a_method_without_residual_is_refused():
  tx = sj.sync_gradients("dense", balance="leaves")
  with pytest.raises(ValueError, match="balance='leaves' .* 'dense' keeps no residual"):
    sj.init_opt_state(tx, PARAMS, harness.mesh(4))


