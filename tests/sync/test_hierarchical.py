"""Hierarchical sync on a (host, local) mesh: a dense reduce-scatter inside each host, SparDL
across hosts on each device's 1/L slice, an all-gather inside the host. Checked against the
NumPy model per slice, for conservation, and from the compiled HLO: only SparDL's messages
cross hosts, with the formula's bytes; beside today's host_teams()."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spardl_jax as sj
from spardl_jax.collectives import SparDLConfig
from spardl_jax.tools import traffic
from tests import formulas, harness, reference

H, L = 2, 4
ROWS = P(("host", "local"))


def mesh():
  return jax.make_mesh((H, L), ("host", "local"), devices=jax.devices()[:8],
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)


def program(tx, params):
  m = mesh()
  state = sj.init_opt_state(tx, params, m, axis_name="host")
  specs = sj.opt_state_specs(tx, params, m, axis_name="host")

  def update(grads, state):
    updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state)
    return jax.tree.map(lambda u: u[None], updates), state

  f = jax.jit(jax.shard_map(update, mesh=m, in_specs=(ROWS, specs), out_specs=(ROWS, specs),
                            check_vma=False))
  return f, state


def test_each_slice_is_the_numpy_model_of_the_host_means():
  params = {"b": jnp.zeros((5,)), "w": jnp.zeros((10, 7))}  # n = 75: 4 slices of 19
  tx = sj.spardl(density=0.2, wire="exact", axis_name="host", local_axis="local")
  f, state = program(tx, params)
  assert state.method_state.residual.shape == (H * L, 19)
  rng = np.random.default_rng(0)
  books = np.zeros((L, H, 19), np.float32)
  for _ in range(3):
    grads = {k: rng.standard_normal((H * L, *v.shape)).astype(np.float32)
             for k, v in params.items()}
    updates, state = f(jax.device_put(grads, NamedSharding(mesh(), ROWS)), state)
    flat = np.concatenate([grads["b"], grads["w"].reshape(H * L, -1)], axis=1)  # tree order
    host_mean = np.pad(flat.reshape(H, L, 75).mean(1), ((0, 0), (0, 1)))  # (H, 76)
    residual = np.asarray(state.method_state.residual).reshape(H, L, 19)
    want = []
    for slot in range(L):  # one SparDL across the hosts per slice
      xs = host_mean[:, slot * 19:(slot + 1) * 19].astype(np.float32)
      y, new_rs = reference.spardl(xs, books[slot], 0.2)
      np.testing.assert_allclose(residual[:, slot], new_rs, rtol=1e-5, atol=1e-6)
      harness.assert_conserved(xs, books[slot], np.stack([y] * H), residual[:, slot])
      books[slot] = residual[:, slot]
      want.append(y)
    want = np.concatenate(want)[:75]
    got = np.concatenate([np.asarray(updates["b"]), np.asarray(updates["w"]).reshape(8, -1)], 1)
    assert np.all(got == got[:1]), "bit-identical on every device"
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)


def cross_host_bytes(hlo, host_of):
  return max(sum(c.bytes for c in hlo.permutes
                 if any(s == d and host_of(s) != host_of(t) for s, t in c.pairs))
             for d in range(8))


def test_only_spardl_crosses_hosts_and_beside_host_teams():
  n, density = 4000, 0.01
  params = {"w": jnp.zeros((n,))}
  tx = sj.spardl(density=density, wire="exact", axis_name="host", local_axis="local")
  f, state = program(tx, params)
  grads = jax.device_put(jnp.ones((8, n)), NamedSharding(mesh(), ROWS))
  hlo = traffic.parse_hlo(f.lower({"w": grads}, state).compile().as_text())
  ids = {d.id: tuple(np.argwhere(mesh().devices == d)[0]) for d in mesh().devices.flat}
  for c in hlo.permutes:  # SparDL's rounds: each between the same slice of the two hosts
    assert all(ids[s][1] == ids[t][1] and ids[s][0] != ids[t][0] for s, t in c.pairs)
  want = formulas.spardl(H, n // L, density)
  assert hlo.rounds == want["rounds"]
  assert all(hlo.bytes_sent(d) == want["bytes"] for d in range(8))
  dense = sorted((c.op, c.elements) for c in hlo.others if c.elements > 1)
  assert dense == [("all-gather", n // L), ("reduce-scatter", n)], dense  # inside the host
  # Today's host_teams(): SparDL on a one-axis mesh of 8 with a team per host (SRS inside
  # the host, R-SAG across): its cross-host part is the SAG's exchange.
  flat = SparDLConfig(density=density, teams=H, wire="exact")
  teams = harness.traffic(8, n, flat)
  host_teams = cross_host_bytes(teams, lambda d: d // L)
  assert host_teams == (formulas.spardl(8, n, density, teams=H)["bytes"]
                        - formulas.spardl(L, n, density)["bytes"])
  assert cross_host_bytes(hlo, lambda d: ids[d][0]) == want["bytes"]


def test_density_one_equals_the_mean_over_every_device():
  params = {"w": jnp.zeros((6, 5))}
  tx = optax.chain(sj.spardl(density=1.0, wire="exact", axis_name="host", local_axis="local"),
                   optax.sgd(1.0))
  f, state = program(tx, params)
  grads = np.random.default_rng(1).standard_normal((8, 6, 5)).astype(np.float32)
  updates, _ = f({"w": jax.device_put(grads, NamedSharding(mesh(), ROWS))}, state)
  np.testing.assert_allclose(np.asarray(updates["w"])[3], -grads.mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    ({"local_axis": "host"}, r"local_axis must be None or the name of a mesh axis other than "
                             r"axis_name='host'"),
    ({"local_axis": 3}, "local_axis must be None"),
])
def test_bad_local_axis_is_a_clear_error(kwargs, match):
  with pytest.raises(ValueError, match=match):
    sj.spardl(density=0.1, axis_name="host", **kwargs)


def _step_and_sync(step_local, sync_local):
  """data_parallel_step split over ``("host", step_local)`` with a sync reducing over
  ``("host", sync_local)`` (None: host alone), one step traced."""
  m = mesh()
  tx = optax.chain(sj.spardl(density=0.5, axis_name="host", local_axis=sync_local),
                   optax.sgd(0.1))
  params = {"w": jnp.ones((16, 4))}
  state = sj.init_opt_state(tx, params, m, axis_name="host")
  step = sj.data_parallel_step(lambda p, x: jnp.mean((x @ p["w"]) ** 2), tx, m,
                               axis_name="host", local_axis=step_local)
  with jax.set_mesh(m):
    step(params, state, jax.device_put(jnp.ones((8, 16)), NamedSharding(m, ROWS)))


@pytest.mark.parametrize("step_local, sync_local, match", [
    # Silent before: each slice of the vector was averaged over one local position's data.
    ("local", None, r"sync_gradients: update: the step splits the batch over \('host', "
                    r"'local'\), but this sync reduces over \('host',\) only; build it with "
                    r"local_axis='local'"),
    (None, "local", r"this sync reduces over \('host', 'local'\) \(local_axis='local'\), but "
                    r"the step splits the batch over \('host',\); give the step "
                    r"local_axis='local' too"),
    ("host", None, r"data_parallel_step: local_axis must be a mesh axis other than "
                   r"axis_name='host'"),
    ("rack", None, r"data_parallel_step: local_axis='rack' is not an axis of the mesh"),
])
def test_a_step_and_a_sync_that_disagree_on_the_data_axes_are_refused(step_local, sync_local,
                                                                       match):
  with pytest.raises(ValueError, match=match):
    _step_and_sync(step_local, sync_local)


def test_a_model_axis_given_as_local_axis_is_named():
  m = jax.make_mesh((2, 2, 2), ("host", "local", "model"), devices=jax.devices()[:8],
                    axis_types=(jax.sharding.AxisType.Explicit,) * 3)
  tx = optax.chain(sj.spardl(density=0.5, axis_name="host", local_axis="model"), optax.sgd(0.1))
  params = {"w": jax.device_put(jnp.ones((16, 4)), NamedSharding(m, P(None, "model")))}
  # Named when the state is built, before any step is traced.
  with jax.set_mesh(m), pytest.raises(
      ValueError, match=r"parameter \['w'\] is sharded over the local_axis \(a second data axis "
                        r"inside a host, not a model axis\) 'model'"):
    sj.init_opt_state(tx, params, m, axis_name="host")
