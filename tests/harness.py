"""Runs spardl_allreduce on P simulated devices and brings the per-device results home."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spardl_jax as sj
from spardl_jax.collectives import sharded_allreduce
from spardl_jax.tools import traffic as hlo_reader
from spardl_jax._src.parallel.rows import shard_rows

AXIS = "data"

# The suite runs a covering set of each large parameter grid: every code path, every row of
# the cost table and every option once, to keep the suite short on two cores. With
# SPARDL_JAX_FULL_TESTS=1 every grid runs whole (about twice the time): before a release, or
# after a change to the schedule, the selection or the wire formats.
FULL = os.environ.get("SPARDL_JAX_FULL_TESTS") == "1"


def grid(every, quick):
  """The parameter cases of a test: ``every`` case with SPARDL_JAX_FULL_TESTS=1, else
  ``quick``, a subset of them chosen to cover each path (checked here)."""
  every, quick = list(every), list(quick)
  missing = [case for case in quick if case not in every]
  if missing:
    raise ValueError(f"grid: quick cases {missing} are not in the full grid")
  return every if FULL else quick


def mesh(p):
  return jax.make_mesh((p,), (AXIS,), devices=jax.devices()[:p],
                       axis_types=(jax.sharding.AxisType.Explicit,))


@functools.lru_cache(maxsize=None)
def compiled(p, config):
  """jit(shard_map(spardl_allreduce)) taking (P, n) gradients and residuals."""
  return sharded_allreduce(config, mesh(p), AXIS)


def executable(p, n, config, dtype=jnp.float32):
  """The compiled program for (P, n) gradients of ``dtype``: one compilation serves both the
  numbers (calling it) and the traffic (its HLO text)."""
  return _executable(p, n, config, np.dtype(dtype))  # one cache key per dtype, however named


@functools.lru_cache(maxsize=None)
def _executable(p, n, config, dtype):
  return _lower(compiled(p, config), sj.methods.from_config(config), p, n, dtype).compile()


def put(p, tree):
  """Shards every leaf of `tree` over its leading (device) axis, with the full-rank spec
  jit gives its outputs (so feeding outputs back does not recompile)."""
  return shard_rows(tree, mesh(p), AXIS)


def rows(p, n, config, dtype=jnp.float32, residuals=None):
  """The (P, ...) state of P devices, sharded; `residuals` (P, n) replaces the zeros."""
  state = sj.collectives.init_rows(sj.methods.from_config(config), p, n, dtype)
  if residuals is not None:
    state = state._replace(residual=np.asarray(residuals, np.dtype(dtype)))
  return put(p, state)


def run_state(xs, state, config):
  """One all-reduce from a sharded state; returns (ys as NumPy (P, n), new state)."""
  p, n = xs.shape
  ys, state = jax.block_until_ready(executable(p, n, config, xs.dtype)(put(p, xs), state))
  return np.asarray(ys), state


def run(xs, rs, config):
  """Returns (ys, new_rs) as NumPy arrays of shape (P, n): every device's y and residual."""
  p, n = xs.shape
  ys, state = run_state(xs, rows(p, n, config, xs.dtype, rs), config)
  return ys, np.asarray(state.residual)


def traffic(p, n, config, dtype=jnp.float32):
  """The collectives of the SparDL program for (P, n) gradients (tools.traffic.Traffic)."""
  return hlo_reader.parse_hlo(executable(p, n, config, dtype).as_text())


def _lower(fn, method, p, n, dtype):
  """`fn` (a `methods.sharded` program) lowered for (P, n) gradients and the method's state."""
  sharding = NamedSharding(mesh(p), P(AXIS))
  spec = jax.ShapeDtypeStruct((p, n), dtype, sharding=sharding)
  state = sj.collectives.abstract_rows(method, p, n, sharding, dtype)
  return fn.lower(spec, state)


@functools.lru_cache(maxsize=None)
def compiled_method(p, method):
  """jit(shard_map(method.apply)) over (P, n) gradients and (P, ...) state rows."""
  return sj.collectives.sharded(method, mesh(p), AXIS)


def nonfinite_agreement(method):
  """The collectives `methods.sharded`'s default nonfinite='skip' adds to `method`'s program:
  one int32 scalar pmax where a NaN may stay out of the result, none where it always reaches
  it (the result then tells every device)."""
  return [] if method.nonfinite_reaches_result else [
      ("all-reduce", (hlo_reader.ArrayType("s32", ()),))]


def method_rows(p, n, method, dtype=jnp.float32):
  """The method's initial state for P devices, sharded over its leading axis."""
  return put(p, sj.collectives.init_rows(method, p, n, dtype))


FLOAT32 = np.dtype(np.float32)


@functools.lru_cache(maxsize=None)
def method_executable(p, n, method, dtype=FLOAT32):
  """`method`'s compiled program for (P, n) gradients: it runs the numbers and its HLO text
  gives the traffic, from one compilation."""
  return _lower(compiled_method(p, method), method, p, n, dtype).compile()


def method_traffic(p, n, method, dtype=FLOAT32):
  """The collectives of `method`'s program for (P, n) gradients."""
  return hlo_reader.parse_hlo(method_executable(p, n, method, np.dtype(dtype)).as_text())


def gradients(rng, p, n, heavy_tails=False):
  """(P, n) float32 local gradients; heavy tails make top-k selections uneven."""
  x = rng.standard_normal((p, n)).astype(np.float32)
  if heavy_tails:
    x *= rng.exponential(size=(p, n)).astype(np.float32) ** 3
  return x


def assert_conserved(xs, rs, ys, new_rs):
  """Conservation: sum of new residuals + P * y equals sum of (x + old residuals), in float64."""
  p = xs.shape[0]
  total_in = (xs.astype(np.float64) + rs).sum(0)
  total_out = new_rs.astype(np.float64).sum(0) + p * ys[0].astype(np.float64)
  scale = np.abs(xs).sum(0) + np.abs(rs).sum(0) + 1
  np.testing.assert_array_less(np.abs(total_out - total_in), 1e-5 * scale)


def flat_rows(tree, keys, p):
  """The (P, n) vectors of the leaves ``keys`` of a tree of (P, ...) rows, in that order."""
  return np.concatenate([np.asarray(tree[k]).reshape(p, -1) for k in keys], axis=1)


def assert_synced(updates, residual, keys, model, inputs, atol):
  """A sync's result (device 0's ``updates``, the leaves ``keys`` in order) and every
  device's ``residual`` equal the NumPy ``model``'s ``(y, new residuals)`` to ``atol``
  (for each), and the books of ``inputs`` ``(xs, old residuals)`` balance."""
  (y, new_rs), (flat, rs) = model, inputs
  got = np.concatenate([np.asarray(updates[k]).reshape(-1) for k in keys])
  np.testing.assert_allclose(got, y, rtol=1e-6, atol=atol[0])
  np.testing.assert_allclose(residual, new_rs, rtol=1e-6, atol=atol[1])
  assert_conserved(flat, rs, np.broadcast_to(y, flat.shape), residual)


def update_fn(tx, p, params):
  """jit(shard_map(tx.update)) over (P, ...) gradients; returns device 0's updates."""
  mesh_ = mesh(p)
  specs = sj.opt_state_specs(tx, params, mesh_)

  def step(grads, state):
    return tx.update(jax.tree.map(lambda g: g[0], grads), state, params)

  return jax.jit(jax.shard_map(step, mesh=mesh_, in_specs=(P(AXIS), specs),
                               out_specs=(P(), specs), check_vma=False))


def put_rows(p, tree):
  """Every leaf of `tree` sharded over its leading (device) axis, as jax.device_put does."""
  return jax.device_put(tree, NamedSharding(mesh(p), P(AXIS)))


def clear() -> None:
  """Drops every program this module compiled and keeps (tests/conftest.py, after each
  module)."""
  for cached in (compiled, _executable, compiled_method, method_executable):
    cached.cache_clear()
