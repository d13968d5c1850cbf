"""Runs spardl_allreduce on P simulated devices and brings the per-device results home."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spardl_jax as sj

AXIS = "data"


def mesh(p):
  return jax.make_mesh((p,), (AXIS,), devices=jax.devices()[:p],
                       axis_types=(jax.sharding.AxisType.Explicit,))


@functools.lru_cache(maxsize=None)
def compiled(p, config):
  """jit(shard_map(spardl_allreduce)) taking (P, n) gradients and residuals."""
  return sj.sharded_allreduce(config, mesh(p), AXIS)


def put(p, tree):
  """Shards every leaf of `tree` over its leading (device) axis, with the full-rank spec
  jit gives its outputs (so feeding outputs back does not recompile)."""
  def one(a):
    a = jnp.asarray(a)
    return jax.device_put(a, NamedSharding(mesh(p), P(AXIS, *[None] * (a.ndim - 1))))
  return jax.tree.map(one, tree)


def rows(p, n, config, dtype=jnp.float32, residuals=None):
  """The (P, ...) state of P devices, sharded; `residuals` (P, n) replaces the zeros."""
  state = sj.methods.init_rows(sj.methods.spardl(config), p, n, dtype)
  if residuals is not None:
    state = state._replace(residual=jnp.asarray(residuals, dtype))
  return put(p, state)


def run_state(xs, state, config):
  """One all-reduce from a sharded state; returns (ys as NumPy (P, n), new state)."""
  p = xs.shape[0]
  ys, state = jax.block_until_ready(compiled(p, config)(put(p, xs), state))
  return np.asarray(ys), state


def run(xs, rs, config):
  """Returns (ys, new_rs) as NumPy arrays of shape (P, n): every device's y and residual."""
  p, n = xs.shape
  ys, state = run_state(xs, rows(p, n, config, xs.dtype, rs), config)
  return ys, np.asarray(state.residual)


def hlo_text(p, n, config, dtype=jnp.float32):
  return _hlo(compiled(p, config), sj.methods.spardl(config), p, n, dtype)


def _hlo(fn, method, p, n, dtype):
  """The compiled HLO of `fn` (a `methods.sharded` program) on (P, n) gradients."""
  sharding = NamedSharding(mesh(p), P(AXIS))
  spec = jax.ShapeDtypeStruct((p, n), dtype, sharding=sharding)
  state = sj.methods.abstract_rows(method, p, n, sharding, dtype)
  return fn.lower(spec, state).compile().as_text()


@functools.lru_cache(maxsize=None)
def compiled_method(p, method):
  """jit(shard_map(method.apply)) over (P, n) gradients and (P, ...) state rows."""
  return sj.methods.sharded(method, mesh(p), AXIS)


def method_rows(p, n, method, dtype=jnp.float32):
  """The method's initial state for P devices, sharded over its leading axis."""
  return put(p, sj.methods.init_rows(method, p, n, dtype))


def method_hlo(p, n, method, dtype=jnp.float32):
  return _hlo(compiled_method(p, method), method, p, n, dtype)
