"""Value dtypes on the wire: the compiled program's bytes follow the gradient's dtype (the
d = 1 traffic of every P is checked with the NumPy model in test_allreduce.py)."""

import jax.numpy as jnp

from spardl_jax.collectives import SparDLConfig
from tests import formulas, harness


def test_bf16_values_halve_the_value_bytes():
  p, n = 4, 10_000
  t = harness.traffic(p, n, SparDLConfig(wire="exact", density=0.01), dtype=jnp.bfloat16)
  assert t.bytes_sent(0) == formulas.spardl(p, n, 0.01, value_bytes=2)["bytes"]
