"""The sync on meshes of several axes: parameters sharded over the axes besides the data axis.

Each column of the data axis (the devices at one position on the other axes) must run the
NumPy model of SparDL on its own local shards, concatenated in tree order; its collectives must
stay inside the column; the books must balance per column; a step is skipped everywhere or
nowhere; at density 1 with the exact wire training equals dense ``jax.jit`` training.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spardl_jax as sj
from spardl_jax.tools import traffic
from tests import formulas, harness, reference

EXPLICIT, AUTO = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto

# (mesh shape, axis names, the parameters' specs): FSDP-style on (4, 2) and (2, 4), FSDP and
# tensor parallelism on (2, 2, 2); the biases stay replicated over the other axes.
MESHES = {
    "4x2": ((4, 2), ("data", "model"),
            {"w1": P(None, "model"), "b1": P(), "w2": P("model", None), "b2": P()}),
    "2x4": ((2, 4), ("data", "model"),
            {"w1": P("model", None), "b1": P("model"), "w2": P(None, None), "b2": P()}),
    "2x2x2": ((2, 2, 2), ("data", "fsdp", "tensor"),
              {"w1": P("fsdp", "tensor"), "b1": P("tensor"), "w2": P("tensor", "fsdp"),
               "b2": P()}),
    # A model axis of size 1 (a config written for several model shards, run on fewer).
    "8x1": ((8, 1), ("data", "model"),
            {"w1": P(None, "model"), "b1": P(), "w2": P("model", None), "b2": P()}),
}
SHAPES = {"b1": (8,), "b2": (4,), "w1": (16, 8), "w2": (8, 4)}  # sorted: the tree's order


def make_mesh(name, kind=EXPLICIT):
  shape, axes, _ = MESHES[name]
  return jax.make_mesh(shape, axes, devices=jax.devices()[:8], axis_types=(kind,) * len(axes))


def put_params(mesh, specs, values=None):
  values = values or {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
  return {k: jax.device_put(jnp.asarray(values[k]), NamedSharding(mesh, specs[k]))
          for k in SHAPES}


def columns(mesh):
  """Every position on the mesh's axes besides "data", as {axis: index}."""
  others = [a for a in mesh.axis_names if a != "data"]
  return [dict(zip(others, c)) for c in itertools.product(*(range(mesh.shape[a])
                                                            for a in others))]


def local(array, spec, coords, mesh):
  """The shard of ``array`` that a device at ``coords`` (other axes) holds under ``spec``."""
  out = array
  for dim, entry in enumerate(spec):
    axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    if not axes:
      continue
    index, count = 0, 1
    for axis in axes:
      index, count = index * mesh.shape[axis] + coords[axis], count * mesh.shape[axis]
    size = array.shape[dim] // count
    out = np.take(out, range(index * size, (index + 1) * size), axis=dim)
  return out


def row(mesh, data, coords):
  """The row of a per-device state leaf that belongs to device (data, coords)."""
  index = data
  for axis in mesh.axis_names:
    if axis != "data":
      index = index * mesh.shape[axis] + coords[axis]
  return index


def manual_update(tx, mesh, specs, state):
  """jit(shard_map over every axis): each device's local gradient shards (with a leading
  data axis of 1) and its state rows in; its state rows and its local update shards out, the
  latter with a leading axis of one row per device (data-major), so that every copy of a
  replicated parameter comes home."""
  grad_specs = {k: P("data", *specs[k]) for k in SHAPES}
  state_specs = sj.opt_state_specs(tx, put_params(mesh, specs), mesh)
  per_device = P(tuple(mesh.axis_names))

  def update(grads, state):
    updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state)
    return jax.tree.map(lambda u: u[None], updates), state

  return jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(grad_specs, state_specs),
                               out_specs=(per_device, state_specs), check_vma=False))


def device_vector(mesh, specs, shards, coords):
  """What docs/design.md ("Sharded models") says a device syncs, rebuilt here: its local
  shards of the leaves sharded over every other axis (of size > 1), in tree order, then for
  each set of other axes R (fewest first) the leaves replicated over R, concatenated,
  zero-padded to |R| equal slices, and the slice at the device's position on R.
  ``shards[k]`` is the device's local shard of leaf k."""
  others = [a for a in mesh.axis_names if a != "data" and mesh.shape[a] > 1]
  groups = {}
  for k in SHAPES:  # tree order
    named = {a for e in specs[k] if e is not None for a in (e if isinstance(e, tuple) else (e,))}
    groups.setdefault(tuple(a for a in others if a not in named), []).append(k)
  parts = []
  for axes in sorted(groups, key=len):
    vec = np.concatenate([np.ravel(shards[k]) for k in groups[axes]])
    r = int(np.prod([mesh.shape[a] for a in axes]))
    chunk = -(-vec.size // r)
    index = 0
    for a in axes:
      index = index * mesh.shape[a] + coords[a]
    parts.append(np.pad(vec, (0, chunk * r - vec.size))[index * chunk:(index + 1) * chunk])
  return np.concatenate(parts)


@pytest.mark.parametrize("name", list(MESHES))
def test_each_column_runs_the_numpy_model_on_its_shards(name):
  mesh = make_mesh(name)
  _, _, specs = MESHES[name]
  p = mesh.shape["data"]
  tx = sj.spardl(density=0.2, wire="exact", param_specs=specs)
  state = sj.init_opt_state(tx, put_params(mesh, specs), mesh)
  zeros = {k: np.zeros(s) for k, s in SHAPES.items()}
  n_local = device_vector(mesh, specs, {k: local(zeros[k], specs[k], columns(mesh)[0], mesh)
                                        for k in SHAPES}, columns(mesh)[0]).size
  assert state.method_state.residual.shape == (mesh.devices.size, n_local)
  update = manual_update(tx, mesh, specs, state)
  rng = np.random.default_rng(7)
  books = {tuple(c.values()): np.zeros((p, n_local), np.float32) for c in columns(mesh)}
  for _ in range(3):  # three syncs, each fed the residuals of the one before
    grads = {k: rng.standard_normal((p, *s)).astype(np.float32) for k, s in SHAPES.items()}
    sharded = {k: jax.device_put(grads[k], NamedSharding(mesh, P("data", *specs[k])))
               for k in SHAPES}
    updates, state = update(sharded, state)
    updates = {k: np.asarray(v) for k, v in updates.items()}
    residual = np.asarray(state.method_state.residual)
    for k in SHAPES:  # every copy of a shard got the same update, replicas included
      for coords in columns(mesh):
        copies = [updates[k][row(mesh, d, c)] for d in range(p) for c in columns(mesh)
                  if np.array_equal(local(grads[k][0], specs[k], c, mesh),
                                    local(grads[k][0], specs[k], coords, mesh))]
        assert all(np.array_equal(c, copies[0]) for c in copies), k
    for coords in columns(mesh):
      xs = np.stack([device_vector(mesh, specs, {k: local(grads[k][d], specs[k], coords, mesh)
                                                 for k in SHAPES}, coords) for d in range(p)])
      rs = books[tuple(coords.values())]
      y, new_rs = reference.spardl(xs, rs, 0.2)
      got = np.stack([device_vector(mesh, specs, {k: updates[k][row(mesh, d, coords)]
                                                  for k in SHAPES}, coords) for d in range(p)])
      assert np.all(got == got[:1]), "bit-identical within a column"
      np.testing.assert_allclose(got[0], y, rtol=1e-6, atol=1e-7)
      mine = residual[[row(mesh, d, coords) for d in range(p)]]
      np.testing.assert_allclose(mine, new_rs, rtol=1e-6, atol=1e-6)
      harness.assert_conserved(xs, rs, got, mine)
      books[tuple(coords.values())] = mine


def test_collectives_stay_inside_the_columns_and_match_the_formula():
  """From the compiled program: every permute pairs devices of one column, each device sends
  the formula's bytes for its local shard size, and nothing else is gradient-sized."""
  mesh = make_mesh("4x2")
  _, _, specs = MESHES["4x2"]
  tx = sj.spardl(density=0.1, wire="exact", param_specs=specs)
  state = sj.init_opt_state(tx, put_params(mesh, specs), mesh)
  grads = {k: jax.device_put(np.ones((4, *s), np.float32),
                             NamedSharding(mesh, P("data", *specs[k]))) for k, s in SHAPES.items()}
  text = manual_update(tx, mesh, specs, state).lower(grads, state).compile().as_text()
  hlo = traffic.parse_hlo(text)
  ids = {d.id: np.argwhere(mesh.devices == d)[0] for d in mesh.devices.flat}
  for c in hlo.permutes:
    for s, t in c.pairs:
      assert ids[s][1] == ids[t][1], f"{c.name} pairs devices of two columns: {s} -> {t}"
  n_local = 16 * 4 + 4 * 4 + (8 + 4) // 2  # w1, w2 shards and half the biases
  want = formulas.spardl(4, n_local, 0.1)
  assert hlo.rounds == want["rounds"]
  for device in range(8):
    assert hlo.bytes_sent(device) == want["bytes"]
  # Besides: the columns agree on skipping a non-finite step (one scalar), and the biases'
  # halves come back together over "model" (6 of their 12 entries from each column).
  assert sorted((c.op, c.elements) for c in hlo.others) == [("all-gather", 6), ("all-reduce", 1)]


def test_a_nonfinite_shard_skips_the_step_in_every_column():
  mesh = make_mesh("4x2")
  _, _, specs = MESHES["4x2"]
  tx = sj.spardl(density=0.2, param_specs=specs)
  state = sj.init_opt_state(tx, put_params(mesh, specs), mesh)
  update = manual_update(tx, mesh, specs, state)
  grads = {k: np.ones((4, *s), np.float32) for k, s in SHAPES.items()}
  grads["w2"][1, 5, 0] = np.nan  # device (data 1, model 1) only: w2 rows 4..7 are model 1's
  sharded = {k: jax.device_put(grads[k], NamedSharding(mesh, P("data", *specs[k])))
             for k in SHAPES}
  updates, new = update(sharded, state)
  for k in SHAPES:
    np.testing.assert_array_equal(np.asarray(updates[k]), 0)
  np.testing.assert_array_equal(np.asarray(new.method_state.residual),
                                np.asarray(state.method_state.residual))
  np.testing.assert_array_equal(np.asarray(new.stats.nonfinite), 1)


def matmul(a, b):
  """``a @ b`` with the rows sharded like ``a``'s and the columns replicated: Explicit axes
  ask for the output sharding of a product whose contracted dimension is sharded."""
  sharding = jax.typeof(a).sharding
  if not any(t == EXPLICIT for t in sharding.mesh.axis_types):
    return a @ b
  return jnp.matmul(a, b, out_sharding=P(sharding.spec[0], None))


def mlp_loss(params, x, y):
  h = jnp.tanh(matmul(x, params["w1"]) + params["b1"])
  return jnp.mean((matmul(h, params["w2"]) + params["b2"] - y) ** 2)


def dense_jit_training(mesh, specs, params, batches, lr):
  """The reference: plain jax.jit on NamedShardings, the global batch's mean gradient."""
  @jax.jit
  def step(params, x, y):
    grads = jax.grad(mlp_loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)

  for x, y in batches:
    params = step(params, x, y)
  return params


def partial_auto_training(mesh, specs, params, batches, lr, tx):
  """A partial-auto shard_map over "data" only; the model axes are left to the compiler."""
  state = sj.init_opt_state(tx, params, mesh, param_specs=specs)
  state_specs = sj.opt_state_specs(tx, params, mesh, param_specs=specs, axis_names={"data"})

  def step(params, state, x, y):
    grads = jax.grad(mlp_loss)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), state_specs, P("data"), P("data")),
                               out_specs=(P(), state_specs), axis_names={"data"},
                               check_vma=False))
  for x, y in batches:
    params, state = step(params, state, x, y)
  return params, state


def jit_entry_point_training(mesh, specs, params, batches, lr, tx):
  """sj.data_parallel_step: the user writes no shard_map at all."""
  state = sj.init_opt_state(tx, params, mesh, param_specs=specs)
  step = sj.data_parallel_step(mlp_loss, tx, mesh)
  for x, y in batches:
    params, state, _ = step(params, state, x, y)
  return params, state


def jit_of_the_step_training(mesh, specs, params, batches, lr, tx):
  """sj.data_parallel_step called inside a jax.jit of the user's own."""
  state = sj.init_opt_state(tx, params, mesh, param_specs=specs)
  step = jax.jit(sj.data_parallel_step(mlp_loss, tx, mesh))
  for x, y in batches:
    params, state, _ = step(params, state, x, y)
  return params, state


# Each style on each kind of axes, and each mesh, once (not every product: suite time).
@pytest.mark.parametrize("name, kind, style", [
    ("4x2", EXPLICIT, partial_auto_training), ("4x2", AUTO, jit_entry_point_training),
    ("2x2x2", AUTO, partial_auto_training), ("2x2x2", EXPLICIT, jit_entry_point_training),
    ("8x1", EXPLICIT, jit_entry_point_training), ("4x2", EXPLICIT, jit_of_the_step_training)],
    ids=["4x2-explicit-partial_auto", "4x2-auto-jit", "2x2x2-auto-partial_auto",
         "2x2x2-explicit-jit", "8x1-explicit-jit", "4x2-explicit-jit_of_the_step"])
def test_at_density_one_training_equals_dense_jit_training(name, kind, style):
  mesh = make_mesh(name, kind)
  _, _, specs = MESHES[name]
  rng = np.random.default_rng(3)
  values = {k: 0.3 * rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
  batches = [(jax.device_put(rng.standard_normal((16, 16)).astype(np.float32),
                             NamedSharding(mesh, P("data"))),
              jax.device_put(rng.standard_normal((16, 4)).astype(np.float32),
                             NamedSharding(mesh, P("data")))) for _ in range(3)]
  # Auto axes hide the layout inside a partial-auto shard_map; the jit entry point reads it
  # from the arrays.
  needs_specs = kind == AUTO and style is partial_auto_training
  tx = optax.chain(sj.spardl(density=1.0, wire="exact",
                             param_specs=specs if needs_specs else None), optax.sgd(0.1))
  with jax.set_mesh(mesh):
    want = dense_jit_training(mesh, specs, put_params(mesh, specs, values), batches, 0.1)
    got, state = style(mesh, specs, put_params(mesh, specs, values), batches, 0.1, tx)
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6)
    if kind == EXPLICIT:  # the parameters keep their layout
      assert tuple(got[k].sharding.spec) + (None,) * 2 == tuple(specs[k]) + (None,) * (
          2 + len(got[k].sharding.spec) - len(specs[k])), (k, got[k].sharding.spec)
  n_local = state[0].method_state.residual.shape[1]
  if mesh.size > mesh.shape["data"]:
    assert n_local < sum(int(np.prod(s)) for s in SHAPES.values()), "local shards, not gathered"


LOOK_AHEAD_STEPS = 4


def look_ahead_training(mesh, specs):
  """4 steps of sj.data_parallel_step with a delayed sync's look-ahead at density 1 (SGD with
  momentum after it), from fixed parameters and batches: the parameters after them."""
  rng = np.random.default_rng(5)
  values = {k: 0.3 * rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
  data = [(rng.standard_normal((16, 16)).astype(np.float32),
           rng.standard_normal((16, 4)).astype(np.float32)) for _ in range(LOOK_AHEAD_STEPS)]
  tx = sj.weight_prediction(sj.spardl(density=1.0, wire="exact", delay=1), optax.sgd(0.1, 0.9))
  with jax.set_mesh(mesh):
    params = put_params(mesh, specs, values)
    state = sj.init_opt_state(tx, params, mesh, param_specs=specs)
    step = sj.data_parallel_step(mlp_loss, tx, mesh)
    for batch in data:
      params, state, _ = step(params, state, *(jax.device_put(a, NamedSharding(mesh, P("data")))
                                               for a in batch))
  return values, {k: np.asarray(v) for k, v in params.items()}


@functools.lru_cache(maxsize=None)
def replicated_look_ahead(devices):
  """The reference: the same run with the parameters replicated on a mesh of one data axis."""
  mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices],
                       axis_types=(EXPLICIT,))
  return look_ahead_training(mesh, {k: P() for k in SHAPES})[1]


# The 8x1 mesh (a model axis of size 1) with SPARDL_JAX_FULL_TESTS=1: suite time.
@pytest.mark.parametrize("name, kind", harness.grid(
    [("4x2", EXPLICIT), ("4x2", AUTO), ("8x1", EXPLICIT)], [("4x2", EXPLICIT), ("4x2", AUTO)]))
def test_a_look_ahead_on_a_sharded_model_trains_as_on_the_data_axis_alone(name, kind):
  """A delayed sync's look-ahead takes its point on each device's shards (in a shard_map over
  the model axes the step leaves open): at density 1 it trains as the same run with the
  parameters replicated on the data axis alone."""
  mesh = make_mesh(name, kind)
  values, got = look_ahead_training(mesh, MESHES[name][2])
  want = replicated_look_ahead(mesh.shape["data"])
  for k in SHAPES:
    assert np.any(got[k] != values[k]), k
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_auto_axes_without_param_specs_is_a_clear_error():
  mesh = make_mesh("4x2", AUTO)
  _, _, specs = MESHES["4x2"]
  tx = sj.spardl(density=0.5)

  def step(grads):
    with pytest.raises(ValueError, match=r"mesh axes \('model',\) are left to the compiler "
                                         r"\(Auto\).*param_specs="):
      tx.init(grads)
    return grads

  jax.eval_shape(jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P(),
                               axis_names={"data"}), put_params(mesh, specs))


@pytest.mark.parametrize("specs, match", [
    ({"w1": P("data", None)}, r"parameter \['w1'\] is sharded over the data axis 'data'"),
    ({"w1": P(None, "expert")}, r"parameter \['w1'\] names the axis 'expert', which is not in "
                                r"the mesh \('data', 'model'\)"),
    ({"b2": P("model")}, None),  # 4 entries over 2 devices: fine
    ({"b1": P(None)}, None),
    ({"b1": P(None, "model")}, r"parameter \['b1'\] of shape \(8,\) cannot be sharded "
                               r"P\(None, 'model'\): it has no dimension 1"),
    ({"b2": P(("model", "data"))}, r"\['b2'\] is sharded over the data axis"),
    ({"w2": P(None, "model"), "w1": P(None, None, "model")}, r"\['w1'\].*no dimension 2"),
])
def test_bad_layouts_are_clear_errors(specs, match):
  mesh = make_mesh("4x2")
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  full = {k: specs.get(k, P()) for k in SHAPES}
  tx = sj.spardl(density=0.5)
  if match is None:
    sj.opt_state_specs(tx, params, mesh, param_specs=full)
    return
  with pytest.raises(ValueError, match=match):
    sj.opt_state_specs(tx, params, mesh, param_specs=full)


# The 4x2 layout with w1 and w2 given each other's specs: every local shard keeps its size.
SWAPPED = {**MESHES["4x2"][2], "w1": P("model", None), "w2": P(None, "model")}
DISAGREE = r"param_specs gives parameter \['w1'\] the layout P\('model', None\), but it is sharded"


def _init_given_swapped(mesh, specs, params):
  sj.init_opt_state(sj.spardl(density=0.5), params, mesh, param_specs=SWAPPED)


def _transformation_swapped_at_init(mesh, specs, params):
  sj.init_opt_state(sj.spardl(density=0.5, param_specs=SWAPPED), params, mesh)


def _transformation_swapped_in_the_step(mesh, specs, params):
  state = sj.init_opt_state(optax.chain(sj.spardl(density=0.5), optax.sgd(0.1)), params, mesh)
  step = sj.data_parallel_step(
      mlp_loss, optax.chain(sj.spardl(density=0.5, param_specs=SWAPPED), optax.sgd(0.1)), mesh)
  x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data")))
  step(params, state, x, jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data"))))


def _update_swapped_on_explicit_axes(mesh, specs, params):
  tx = sj.spardl(density=0.5)
  state = sj.init_opt_state(tx, params, mesh)
  state_specs = sj.opt_state_specs(tx, params, mesh, axis_names={"data"})
  jax.eval_shape(jax.shard_map(lambda g, s: tx.update(g, s, param_specs=SWAPPED),
                               mesh=mesh, in_specs=(P(), state_specs), out_specs=P(),
                               axis_names={"data"}, check_vma=False), params, state)


@pytest.mark.parametrize("kind, where, match", [
    (AUTO, _init_given_swapped, DISAGREE),
    (EXPLICIT, _update_swapped_on_explicit_axes, DISAGREE),
    (AUTO, _transformation_swapped_at_init,
     r"sync_gradients: init: param_specs of the transformation gives parameter \['w1'\] the "
     r"layout P\('model', None\), but use_param_specs .* gives P\(None, 'model'\)"),
    (EXPLICIT, _transformation_swapped_in_the_step,
     r"sync_gradients: update: param_specs of the transformation gives parameter \['w1'\] "
     r"the layout P\('model', None\), but tx.update's param_specs .* gives P\(None, 'model'\)"),
], ids=["init_opt_state", "update-explicit", "transformation-init", "transformation-step"])
def test_param_specs_that_disagree_with_the_arrays_are_refused(kind, where, match):
  """Where the arrays show their layout, specs given beside them must say the same: the
  local shards keep their sizes here, so nothing else would notice, and each device would
  cut its vector from shards it does not hold."""
  mesh = make_mesh("4x2", kind)
  _, _, specs = MESHES["4x2"]
  with jax.set_mesh(mesh), pytest.raises(ValueError, match=match):
    where(mesh, specs, put_params(mesh, specs))


def test_unknown_axis_is_a_clear_error():
  mesh = make_mesh("4x2")
  with pytest.raises(ValueError, match=r"opt_state_specs: axis_name='batch' is not an axis of "
                                       r"the mesh; its axes are \('data', 'model'\)"):
    sj.opt_state_specs(sj.spardl(density=0.5), {"w": jnp.zeros(4)}, mesh, axis_name="batch")


def test_state_shaped_like_the_parameters_takes_their_specs():
  mesh = make_mesh("2x2x2")
  _, _, specs = MESHES["2x2x2"]
  tx = optax.chain(sj.spardl(density=0.5), optax.adam(1e-3))
  got = sj.opt_state_specs(tx, put_params(mesh, specs), mesh)
  assert got[0].method_state.residual == P(("data", "fsdp", "tensor"))
  assert got[1][0].mu == specs and got[1][0].nu == specs
  assert got[1][0].count == P()
  partial = sj.opt_state_specs(tx, put_params(mesh, specs), mesh, axis_names={"data"})
  assert partial[0].method_state.residual == P("data")
  assert partial[1][0].mu == {k: P() for k in SHAPES}


@pytest.mark.parametrize("tx, match", [
    (sj.spardl(density=0.5), r"the sync runs inside a shard_map over the mesh axes \('model',\) "
                             r"besides 'data'.*pass param_specs="),
    (sj.sync_gradients("powersgd", rank=1, param_specs=MESHES["4x2"][2]),
     r"'powersgd' compresses each parameter as a matrix, but some parameters are replicated"),
])
def test_a_layout_the_sync_cannot_serve_is_a_clear_error(tx, match):
  mesh = make_mesh("4x2")
  _, _, specs = MESHES["4x2"]
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=P(),
                                 check_vma=False), put_params(mesh, specs))


def test_multisteps_on_several_axes_is_a_clear_error():
  mesh = make_mesh("4x2")
  _, _, specs = MESHES["4x2"]
  tx = optax.MultiSteps(optax.chain(sj.spardl(density=0.5), optax.sgd(0.1)), 2)
  with pytest.raises(ValueError, match="MultiSteps around a gradient sync is supported on a "
                                       "one-axis mesh only"):
    sj.opt_state_specs(tx, put_params(mesh, specs), mesh)
