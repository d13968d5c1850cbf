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


def put(p, a):
  return jax.device_put(jnp.asarray(a), NamedSharding(mesh(p), P(AXIS)))


def run(xs, rs, config):
  """Returns (ys, new_rs) as NumPy arrays of shape (P, n): every device's y and residual."""
  p = xs.shape[0]
  ys, new_rs = jax.block_until_ready(compiled(p, config)(put(p, xs), put(p, rs)))
  return np.asarray(ys), np.asarray(new_rs)


def hlo_text(p, n, config, dtype=jnp.float32):
  spec = jax.ShapeDtypeStruct((p, n), dtype, sharding=NamedSharding(mesh(p), P(AXIS)))
  return compiled(p, config).lower(spec, spec).compile().as_text()
