"""Islands in the outer loop: each replica a group of devices whose inner optimizer holds a
sync of its own over the island's data axis. Against a NumPy DiLoCo whose replicas step on
their island's mean gradient, with a dense and a SparDL outer sync (each device of an island
its slice across the islands); the islands' devices bit-identical; Streaming DiLoCo's
fragments and overlap against their NumPy model, no inner step lost; the bytes over each
link against the compiled HLO and the cost table; a refold onto another island count; a
non-finite gradient skipping one island's inner step on every device of it; the errors."""

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

N = 7  # w[:6] weights, w[6] the bias
ROWS = 8  # examples a device


def islands_mesh(m, l):  # noqa: E741  (l devices an island)
  return jax.make_mesh((m, l), ("island", "data"), devices=jax.devices()[:m * l])


def island_diloco(sync, *, lr=0.05, momentum=0.9, every=3, **options):
  inner = optax.chain(sj.sync_gradients("dense", axis_name="data"),
                      optax.sgd(lr, momentum=momentum))
  return sj.diloco(inner, sync, every=every, **options)


def loss(w, x, y):
  return jnp.mean((x @ w[:6] + w[6] - y) ** 2)


def batches_for(rng, devices, steps):
  return [(rng.standard_normal((devices * ROWS, 6)).astype(np.float32),
           rng.standard_normal((devices * ROWS,)).astype(np.float32)) for _ in range(steps)]


def train(tx, mesh, batches):
  """The data-parallel step over (island, data); every device's parameters checked
  bit-identical after each step (they are replicated: the step returns one copy, so each
  device's offset copy is checked within its island instead)."""
  params = jnp.zeros((N,), jnp.float32)
  state = sj.init_opt_state(tx, params, mesh, axis_name="island")
  step = sj.data_parallel_step(loss, tx, mesh, axis_name="island", local_axis="data")
  for x, y in batches:
    params, state, _ = step(params, state, x, y)
  return np.asarray(params), state


def numpy_islands(batches, *, m, every, lr, momentum, outer_lr, outer_momentum, sync):
  """DiLoCo in NumPy whose ``m`` replicas each step on their island's mean gradient (the
  island's rows, island-major in the batch); ``sync((M, N)) -> (N,)`` averages the
  pseudo-gradients; the outer Nesterov step is optax's."""
  w = np.zeros(N, np.float32)
  local, velocity = np.zeros((m, N), np.float32), np.zeros((m, N), np.float32)
  outer_trace = np.zeros(N, np.float32)
  for t, (x, y) in enumerate(batches):
    per = len(y) // m
    for i in range(m):
      xi, yi = x[i * per:(i + 1) * per], y[i * per:(i + 1) * per]
      err = xi @ local[i, :6] + local[i, 6] - yi
      g = np.concatenate([2 * xi.T @ err, [2 * err.sum()]]) / len(yi)
      velocity[i] = g + momentum * velocity[i]
      local[i] = local[i] - lr * velocity[i]
    if (t + 1) % every == 0:
      mean = sync(w[None] - local)
      outer_trace = mean + outer_momentum * outer_trace
      w = w - outer_lr * (mean + outer_momentum * outer_trace)
      local = np.repeat(w[None], m, axis=0)
  return w


def sliced_spardl(density, m, l, wire="exact"):  # noqa: E741
  """The model of the SparDL outer sync over islands: each island's pseudo-gradient in ``l``
  slices of ceil(N / l) (zero-padded), device j of every island syncing slice j across the
  ``m`` islands with SparDL of M workers, its residual kept per device."""
  chunk = -(-N // l)
  residuals = np.zeros((m, l, chunk), np.float32)

  def sync(pseudo):
    padded = np.zeros((m, l * chunk), np.float32)
    padded[:, :N] = pseudo
    slices = padded.reshape(m, l, chunk)
    means = []
    for j in range(l):
      y, residuals[:, j] = reference.spardl(slices[:, j], residuals[:, j], density, wire=wire)
      means.append(y)
    return np.concatenate(means)[:N]

  return sync, residuals


@pytest.mark.parametrize("method", ["dense", "spardl"])
def test_each_island_is_one_replica_on_its_mean_gradient(method):
  """2 islands of 2 devices, momentum SGD inside, DiLoCo's outer step, H = 3, 3 rounds: the
  NumPy DiLoCo of 2 replicas each fed its island's mean gradient; with SparDL at 30 % across
  the islands, each slice is SparDL of 2 workers with its own residual."""
  m, l, every = 2, 2, 3  # noqa: E741
  mesh = islands_mesh(m, l)
  batches = batches_for(np.random.default_rng(1), m * l, 3 * every)
  if method == "dense":
    sync, model_sync = sj.sync_gradients("dense", axis_name="island"), (
        lambda pseudo: pseudo.mean(axis=0))
  else:
    sync = sj.spardl(axis_name="island", density=0.3, wire="exact")
    model_sync, residuals = sliced_spardl(0.3, m, l)
  got, state = train(island_diloco(sync, every=every), mesh, batches)
  want = numpy_islands(batches, m=m, every=every, lr=0.05, momentum=0.9, outer_lr=0.7,
                       outer_momentum=0.9, sync=model_sync)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
  assert np.asarray(state.offset).shape == (m, N) and not np.asarray(state.offset).any()
  if method == "spardl":  # rows island-major: device (i, j) holds island i's slice j
    np.testing.assert_allclose(np.asarray(state.sync.method_state.residual),
                               residuals.reshape(m * l, -1), rtol=2e-5, atol=2e-6)


def test_an_islands_devices_hold_one_replica_bit_for_bit():
  """Each device returns its replica's parameters mid-round from a step of its own (a
  ``shard_map`` over both axes, the outer sync told the parameters' layout): an island's
  devices agree to the bit and the islands differ (their batches do); the state keeps one
  offset an island and the islands' own sync its rows per device."""
  m, l = 2, 4  # noqa: E741
  mesh = islands_mesh(m, l)
  tx = island_diloco(sj.spardl(axis_name="island", density=0.3, param_specs=P()), every=5)
  params = jnp.zeros((N,), jnp.float32)
  specs = sj.opt_state_specs(tx, params, mesh, axis_name="island")
  assert specs.offset == P("island", None)
  assert specs.sync.method_state.residual == P(("island", "data"))
  assert specs.inner[0].count == P(("island", "data"))
  rows = P(("island", "data"))

  def local(params, state, x, y):
    grads = jax.grad(loss)(sj.points.replica_params(state, params), x, y)
    updates, state = tx.update(grads, state, params)
    return sj.points.replica_params(state, params)[None], state

  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, rows, rows),
                               out_specs=(rows, specs), check_vma=False))
  state = sj.init_opt_state(tx, params, mesh, axis_name="island")
  for x, y in batches_for(np.random.default_rng(2), m * l, 2):
    replicas, state = step(params, state, *(jax.device_put(a, NamedSharding(mesh, rows))
                                            for a in (x, y)))
  replicas = np.asarray(replicas).reshape(m, l, N)
  for island in replicas:
    np.testing.assert_array_equal(island, np.broadcast_to(island[0], island.shape))
  assert (replicas[0, 0] != replicas[1, 0]).any()


def numpy_streaming(cs, *, every, fragments, overlap, parts):
  """Streaming DiLoCo in NumPy for a loss linear in the parameters (each replica's gradient
  is its row of ``c``), inner SGD at lr 1, a dense outer sync and outer SGD at lr 1: fragment
  ``f`` (the entries ``parts[f]``) is held at steps ``s % every == turn_f``, synced at the
  next, and lands ``overlap`` steps after its turn, its offset keeping the steps since."""
  p = cs[0].shape[0]
  w, offset, held = np.zeros(N), np.zeros((p, N)), np.zeros((p, N))
  turns = [(f + 1) * every // fragments % every for f in range(fragments)]
  for s, c in enumerate(cs, start=1):
    offset = offset - c
    for f, turn in enumerate(turns):
      phase, idx = (s - turn) % every, parts[f]
      if overlap == 0 and phase == 0:
        w[idx] -= (-offset[:, idx]).mean(0)
        offset[:, idx] = 0
      elif overlap and phase == 0:
        held[:, idx] = offset[:, idx]
      if overlap and phase == overlap:
        w[idx] -= (-held[:, idx]).mean(0)
        offset[:, idx] -= held[:, idx]
        held[:, idx] = 0
  return w, offset


@pytest.mark.parametrize("fragments,overlap", [(2, 0), (2, 1), (1, 2)])
def test_fragments_and_overlap_match_the_numpy_model(fragments, overlap):
  """Two leaves of 3 and 4 entries in 2 fragments, H = 4, synced at staggered steps; the
  overlapped update lands a step (or two) after its turn and the replicas keep the inner
  steps taken meanwhile: the global parameters and each replica's offset after 10 steps are
  the model's, and the outer syncs' books say no step was lost."""
  p, every = 4, 4
  mesh = harness.mesh(p)
  params = {"a": jnp.zeros((3,)), "b": jnp.zeros((4,))}
  tx = sj.diloco(optax.sgd(1.0), sj.sync_gradients("dense"), every=every,
                 outer=optax.sgd(1.0), fragments=fragments, overlap=overlap)
  specs = sj.opt_state_specs(tx, params, mesh)

  def local(params, state, c):
    grads = {"a": c[0, :3], "b": c[0, 3:]}  # the gradient of <c, w>
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P(harness.AXIS)),
                               out_specs=(P(), specs), check_vma=False))
  state = sj.init_opt_state(tx, params, mesh)
  rng = np.random.default_rng(4)
  cs = [rng.standard_normal((p, N)).astype(np.float32) for _ in range(10)]
  for c in cs:
    params, state = step(params, state, harness.put_rows(p, c))
  parts = [np.arange(3), np.arange(3, N)] if fragments == 2 else [np.arange(N)]
  want_w, want_offset = numpy_streaming(cs, every=every, fragments=fragments,
                                        overlap=overlap, parts=parts)
  got_w = np.concatenate([np.asarray(params["a"]), np.asarray(params["b"])])
  np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-5)
  got_offset = np.concatenate([np.asarray(state.offset["a"]), np.asarray(state.offset["b"])], 1)
  np.testing.assert_allclose(got_offset, want_offset, rtol=1e-5, atol=1e-5)
  # Every inner step is in the parameters or an offset: their sum is what the replicas took.
  np.testing.assert_allclose(got_w + got_offset.mean(0), -np.sum(cs, axis=0).mean(0),
                             rtol=1e-5, atol=1e-5)


def test_the_bytes_over_each_link_are_the_hlos():
  """2 islands of 4, SparDL at 5 % on the exact wire across them, a dense sync inside: on an
  outer step each device sends SparDL's bytes for its slice (n / 4 entries, 2 workers) over
  permutes that join the same slice of the two islands and nothing else; inside an island
  the dense sync's all-reduce of n entries and the slices' all-gather; the statistics over
  each axis say the same."""
  m, l, n, density = 2, 4, 4000, 0.05  # noqa: E741
  mesh = islands_mesh(m, l)
  tx = sj.diloco(optax.chain(sj.sync_gradients("dense", axis_name="data"), optax.sgd(0.1)),
                 sj.spardl(axis_name="island", density=density, wire="exact"), every=2)
  params = jnp.zeros((n,), jnp.float32)
  state = sj.init_opt_state(tx, params, mesh, axis_name="island")
  step = sj.data_parallel_step(lambda w, x: jnp.mean(x @ w), tx, mesh, axis_name="island",
                               local_axis="data")
  x = jax.device_put(jnp.ones((8, n)), NamedSharding(mesh, P(("island", "data"))))
  hlo = traffic.parse_hlo(step.lower(params, state, x).compile().as_text()).branch(0)
  where = {d.id: tuple(np.argwhere(mesh.devices == d)[0]) for d in mesh.devices.flat}
  for c in hlo.permutes:  # SparDL's rounds: each between the same slice of the two islands
    assert all(where[s][1] == where[t][1] and where[s][0] != where[t][0] for s, t in c.pairs)
  want = formulas.spardl(m, n // l, density)
  assert hlo.rounds == want["rounds"]
  assert all(hlo.bytes_sent(d) == want["bytes"] for d in range(m * l))
  inside = sorted((c.op, c.elements) for c in hlo.others if c.elements > 1)
  assert inside == [("all-gather", n // l), ("all-reduce", n)], inside
  for t in range(2):
    _, state, _ = step(params, state, x)
    across = sj.sync_stats(state, axis="island").bytes_sent
    np.testing.assert_array_equal(np.asarray(across), want["bytes"] if t else 0)
    within = sj.sync_stats(state, axis="data").bytes_sent
    np.testing.assert_array_equal(np.asarray(within), formulas.dense(l, n)["bytes"])


def test_a_refold_onto_another_island_count_keeps_the_books():
  """Saved on 2 islands of 2, restored onto 4 islands of 2: every island gets the replicas'
  mean offset, each slice's residual mass across the islands is conserved, the counts go
  on; another island size is refused by name."""
  tx = island_diloco(sj.spardl(axis_name="island", density=0.3), every=5)
  _, state = train(tx, islands_mesh(2, 2), batches_for(np.random.default_rng(6), 4, 3))
  saved = jax.device_get(state)
  like = sj.init_opt_state(tx, jnp.zeros((N,)), islands_mesh(4, 2), axis_name="island")
  folded = sj.checkpoint.refold(saved, like)
  np.testing.assert_allclose(np.asarray(folded.offset),
                             np.broadcast_to(np.asarray(saved.offset).mean(0), (4, N)),
                             rtol=1e-6, atol=1e-7)
  before = np.asarray(saved.sync.method_state.residual, np.float64).reshape(2, 2, -1)
  after = np.asarray(folded.sync.method_state.residual, np.float64).reshape(4, 2, -1)
  np.testing.assert_allclose(after.sum(0), before.sum(0), rtol=1e-6, atol=1e-7)
  assert int(folded.count) == 3
  other = sj.init_opt_state(tx, jnp.zeros((N,)), islands_mesh(2, 4), axis_name="island")
  with pytest.raises(sj.checkpoint.RefoldError, match="only the island count may change"):
    sj.checkpoint.refold(saved, other)


def test_a_nonfinite_gradient_skips_its_islands_inner_step_on_every_device():
  """A NaN in one device's rows of island 1: that island's own sync skips the step on both
  its devices, so the island's replica (its offset and momentum) stays as it was, bit for
  bit; island 0 moves."""
  m, l = 2, 2  # noqa: E741
  mesh = islands_mesh(m, l)
  tx = island_diloco(sj.sync_gradients("dense", axis_name="island"), every=4)
  params = jnp.zeros((N,), jnp.float32)
  state = sj.init_opt_state(tx, params, mesh, axis_name="island")
  step = sj.data_parallel_step(loss, tx, mesh, axis_name="island", local_axis="data")
  (x, y), = batches_for(np.random.default_rng(7), m * l, 1)
  _, state, _ = step(params, state, x, y)
  before = jax.device_get(state)
  x = x.copy()
  x[3 * ROWS] = np.nan  # device (1, 1): island 1
  _, state, _ = step(params, state, x, y)
  offset, trace = np.asarray(state.offset), np.asarray(state.inner[1][0].trace)
  np.testing.assert_array_equal(offset[1], np.asarray(before.offset)[1])
  np.testing.assert_array_equal(trace[1], np.asarray(before.inner[1][0].trace)[1])
  assert (offset[0] != np.asarray(before.offset)[0]).all()
  assert np.isfinite(offset).all()
  skipped = np.asarray(state.inner[0].stats.nonfinite).reshape(m, l)
  np.testing.assert_array_equal(skipped, [[0, 0], [1, 1]])


def test_bad_options_and_layouts_are_named():
  sync = sj.spardl(axis_name="island")
  with pytest.raises(ValueError, match=r"fragments must be an int in \[1, every\]"):
    sj.diloco(optax.sgd(0.1), sync, every=3, fragments=4)
  with pytest.raises(ValueError, match=r"overlap must be an int in \[0, every // fragments\)"):
    sj.diloco(optax.sgd(0.1), sync, every=4, fragments=2, overlap=2)
  mesh = islands_mesh(2, 2)
  same = sj.diloco(optax.chain(sj.sync_gradients("dense", axis_name="island"),
                               optax.sgd(0.1)), sync, every=2)
  with pytest.raises(ValueError, match="inner holds a gradient sync over 'island'"):
    sj.init_opt_state(same, jnp.zeros((N,)), mesh, axis_name="island")
  tx = island_diloco(sync, every=2)
  state = sj.init_opt_state(tx, jnp.zeros((N,)), mesh, axis_name="island")
  step = sj.data_parallel_step(loss, tx, mesh, axis_name="island")
  (x, y), = batches_for(np.random.default_rng(8), 4, 1)
  with pytest.raises(ValueError, match=r"splits the batch over \('island',\).*local_axis='data'"):
    step(jnp.zeros((N,)), state, x, y)
