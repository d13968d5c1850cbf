"""The compact wire format (16-bit offsets, bfloat16 values) and the quantized ones (int8,
int4, int2 values with a power-of-two scale per block) against the NumPy model with the same
rounding, their exact bookkeeping, and their bytes in the compiled program."""

import jax.numpy as jnp
import numpy as np
import pytest

from spardl_jax.collectives import SparDLConfig
from spardl_jax._src.core import cost, schedule
from tests import formulas, harness, reference

# (P, teams, sag, n, density): every P of the issue (1, 2, 3, 5, 8, 12), teams 1, 2 (R-SAG) and
# 3 (B-SAG), n not divisible by P, the three densities, two-stage selection (5003), and blocks
# longer than 65,536 entries (several count segments: the high bits of an offset travel only
# in the counts), with and without Spar-All-Gather.
CASES = [
    (1, 1, "recursive", 1237, 0.3),
    (2, 1, "recursive", 300_001, 0.01),
    (3, 1, "recursive", 1237, 1.0),
    (5, 1, "recursive", 1237, 0.01),
    (8, 2, "recursive", 5003, 0.3),
    (4, 2, "recursive", 200_003, 0.01),
    (12, 3, "bruck", 1237, 0.01),
]
CASES = [(*case, "compact") for case in CASES] + [
    # Each quantized format once through SRS alone, R-SAG (with several count segments) and
    # B-SAG (which sends a rounded block's top-h again: a power-of-two scale keeps its bits).
    (5, 1, "recursive", 1237, 0.01, "int2"),
    (4, 2, "recursive", 200_003, 0.01, "int8"),
    (12, 3, "bruck", 1237, 0.01, "int4"),
    (8, 2, "recursive", 5003, 0.3, "int2"),
]
# The compact wire's cases of the same shape as a quantized one (the same blocks, segments and
# SAG; only the value format differs) run with SPARDL_JAX_FULL_TESTS=1.
CASES = harness.grid(CASES, [case for case in CASES if case not in (
    (5, 1, "recursive", 1237, 0.01, "compact"), (4, 2, "recursive", 200_003, 0.01, "compact"),
    (12, 3, "bruck", 1237, 0.01, "compact"))])


@pytest.mark.parametrize("p,d,sag,n,density,wire", CASES)
def test_rounding_wire_matches_numpy_model_conserves_and_sends_the_formula(p, d, sag, n, density,
                                                                           wire):
  """Three syncs fed back: the model's results and residuals, bit-identical devices,
  conservation to float32 rounding (not the wire's), and the compiled program's bytes."""
  config = SparDLConfig(density=density, teams=d, sag=sag, wire=wire)
  rng = np.random.default_rng(p * 7 + d)
  state = harness.rows(p, n, config)
  used = set()
  for it in range(3):
    xs = harness.gradients(rng, p, n, heavy_tails=it == 1)
    rs = np.asarray(state.residual)
    ys, state = harness.run_state(xs, state, config)
    new_rs = np.asarray(state.residual)
    h = int(np.asarray(state.controller.last_h)[0])
    used.add(h)
    want_y, want_rs = reference.spardl(xs, rs, density, teams=d, sag=sag, h=h, wire=wire)
    np.testing.assert_array_equal(ys, np.broadcast_to(ys[0], ys.shape))  # bit-identical
    np.testing.assert_allclose(ys[0], want_y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(new_rs, want_rs, rtol=1e-6, atol=1e-6)
    harness.assert_conserved(xs, rs, ys, new_rs)
    if wire == "compact" and density < 1:  # the values really travel in bfloat16
      sent = ys[0][ys[0] != 0] * p
      assert np.abs(sent - reference.as_sent(sent, "compact")).max() <= 1e-6 * np.abs(sent).max()
  hlo = harness.traffic(p, n, config)
  for h in used:
    want = formulas.spardl(p, n, density, teams=d, sag=sag, h=h, wire=wire)
    branch = hlo.branch(schedule.h_ladder(want["kb"], d).index(h)) if sag == "bruck" else hlo
    assert branch.rounds == want["rounds"]
    for device in range(p):
      assert branch.bytes_sent(device) == branch.bytes_received(device) == want["bytes"]
    assert not branch.others


def test_compact_halves_the_bytes_at_the_papers_size():
  """The formula at n = 14.7M, 1 %, P = 8 (checked against HLO above for smaller n)."""
  exact = cost.spardl_cost(8, 14_700_000, 0.01, 1).bytes
  compact = cost.spardl_cost(8, 14_700_000, 0.01, 1, wire="compact").bytes
  assert compact == formulas.spardl(8, 14_700_000, 0.01, wire="compact")["bytes"]
  assert compact <= 0.53 * exact


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_gradients_travel_unchanged(dtype):
  """float16 and bfloat16 values are not rounded again: results equal the exact format's bit
  for bit, residuals too, and only the offsets shrink."""
  p, n, density = 4, 800, 0.1
  rng = np.random.default_rng(0)
  xs = harness.gradients(rng, p, n).astype(dtype)
  rs = (harness.gradients(rng, p, n) * 0.1).astype(dtype)
  exact = harness.run(xs, rs, SparDLConfig(density=density))
  compact_config = SparDLConfig(density=density, wire="compact")
  compact = harness.run(xs, rs, compact_config)
  for got, want in zip(compact, exact):
    np.testing.assert_array_equal(got, want)
  t = harness.traffic(p, n, compact_config, dtype=dtype)
  assert t.bytes_sent(0) == formulas.spardl(p, n, density, value_bytes=2, wire="compact")["bytes"]


def test_residual_modes_keep_only_the_rounding_error_of_what_was_sent():
  p, n, density = 3, 1237, 0.05
  rng = np.random.default_rng(5)
  xs = harness.gradients(rng, p, n)
  rs = np.zeros_like(xs)
  for residuals in ("local", "none"):
    config = SparDLConfig(density=density, residuals=residuals, wire="compact")
    ys, new_rs = harness.run(xs, rs, config)
    want_y, want_rs = reference.spardl(xs, rs, density, residuals, wire="compact")
    np.testing.assert_allclose(ys[0], want_y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(new_rs, want_rs, rtol=1e-6, atol=1e-6)


def test_quantized_bytes_at_the_papers_size():
  """Per pair, compact sends 4 bytes; int8 3, int4 2.5, int2 2.25 (n = 14.7M, 1 %, P = 8)."""
  compact = cost.spardl_cost(8, 14_700_000, 0.01, 1, wire="compact").bytes
  for wire, ratio in (("int8", 3 / 4), ("int4", 2.5 / 4), ("int2", 2.25 / 4)):
    got = cost.spardl_cost(8, 14_700_000, 0.01, 1, wire=wire).bytes
    assert got == formulas.spardl(8, 14_700_000, 0.01, wire=wire)["bytes"]
    assert got == pytest.approx(ratio * compact, rel=1e-3)


@pytest.mark.parametrize("wire", ["int8", "int2"])
def test_quantized_values_keep_nonfinite_and_tiny_blocks(wire):
  """A NaN in a block reaches every device's result, so every device skips the sync (zeros,
  residuals kept); a block near float32's least normal number conserves its mass."""
  p, n = 2, 64
  xs = np.full((p, n), 1e-37, np.float32)
  xs[0, 5] = np.nan
  ys, rs = harness.run(xs, np.zeros_like(xs), SparDLConfig(density=1.0, wire=wire))
  assert not ys.any() and not rs.any()
  xs = np.full((p, n), 3e-38, np.float32)
  ys, rs = harness.run(xs, np.zeros_like(xs), SparDLConfig(density=1.0, wire=wire))
  harness.assert_conserved(xs, np.zeros_like(xs), ys, rs)


def test_bad_wire_is_named():
  with pytest.raises(ValueError, match=r"wire must be one of \('exact', 'compact', 'int8', "
                                       r"'int4', 'int2'\)"):
    SparDLConfig(density=0.1, wire="bf16")
