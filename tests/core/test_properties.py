"""Property tests of the whole all-reduce over random worker counts, sizes, densities and
inputs full of ties and all-zero blocks."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spardl_jax.collectives import SparDLConfig
from tests import harness, reference


@st.composite
def cases(draw):
  p = draw(st.integers(1, 16))
  n = draw(st.integers(1, 400))
  density = draw(st.sampled_from([1.0, 0.5, 0.2, 0.05, 0.01, 1e-4]))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  kind = draw(st.sampled_from(["normal", "ties", "sparse", "zeros"]))
  if kind == "normal":
    xs = rng.standard_normal((p, n))
  elif kind == "ties":
    xs = rng.integers(-2, 3, (p, n)).astype(float)
  elif kind == "sparse":  # whole zero blocks with a few spikes
    xs = np.where(rng.random((p, n)) < 0.03, rng.standard_normal((p, n)), 0.0)
  else:
    xs = np.zeros((p, n))
  rs = np.where(rng.random((p, n)) < 0.5, rng.standard_normal((p, n)) * 0.1, 0.0)
  return xs.astype(np.float32), rs.astype(np.float32), density


@settings(max_examples=25 if harness.FULL else 10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_random_cases_match_model_and_conserve_mass(case):
  xs, rs, density = case
  ys, new_rs = harness.run(xs, rs, SparDLConfig(wire="exact", density=density))
  want_y, want_rs = reference.spardl(xs, rs, density)
  np.testing.assert_array_equal(ys, np.broadcast_to(ys[0], ys.shape))
  np.testing.assert_allclose(ys[0], want_y, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(new_rs, want_rs, rtol=1e-6, atol=1e-6)
  harness.assert_conserved(xs, rs, ys, new_rs)
