"""Spar-All-Gather (teams d > 1): R-SAG and B-SAG against the NumPy model, their invariants,
their HLO traffic, the h controller, and the alpha-beta choice of d."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spardl_jax.collectives import Blocks, SparDLConfig
from spardl_jax._src.core import allreduce, cost, h_controller, schedule
from spardl_jax._src.core.sparse import INVALID, sorted_sum
from tests import formulas, harness, reference

DENSITY = 0.05


def run_steps(p, d, sag, n, steps, seed=0):
  """Yields (xs, rs, ys, state) for `steps` syncs with the state fed back."""
  config = SparDLConfig(wire="exact", density=DENSITY, teams=d, sag=sag)
  rng = np.random.default_rng(seed)
  state = harness.rows(p, n, config)
  for it in range(steps):
    xs = harness.gradients(rng, p, n, heavy_tails=it == 1)
    rs = np.asarray(state.residual)
    ys, state = harness.run_state(xs, state, config)
    yield xs, rs, ys, state


def assert_traffic(p, d, n, sag, h=None):
  """HLO rounds and bytes (of the branch with message size h) equal the cost table's."""
  config = SparDLConfig(wire="exact", density=DENSITY, teams=d, sag=sag)
  hlo = harness.traffic(p, n, config)
  want = formulas.spardl(p, n, DENSITY, teams=d, sag=sag, h=h)
  if sag == "bruck":
    hlo = hlo.branch(schedule.h_ladder(want["kb"], d).index(h))
  assert hlo.rounds == want["rounds"]
  for device in range(p):
    assert hlo.bytes_sent(device) == want["bytes"]
    assert hlo.elements_sent(device) == want["elements"]  # float32: one u32 word each
  assert not hlo.others


@pytest.mark.parametrize("p,d", harness.grid(
    [(4, 2), (8, 2), (8, 4), (12, 2), (16, 4), (16, 8)],
    [(4, 2), (12, 2), (16, 8)]))  # two teams of 2 and of 6 (not a power of two), eight of 2
def test_recursive_sag_matches_numpy_model(p, d):
  n = 1237
  for xs, rs, ys, state in run_steps(p, d, "recursive", n, 3, seed=p + d):
    want_y, want_rs = reference.spardl(xs, rs, DENSITY, teams=d, sag="recursive")
    new_rs = np.asarray(state.residual)
    np.testing.assert_array_equal(ys, np.broadcast_to(ys[0], ys.shape))  # bit-identical
    np.testing.assert_allclose(ys[0], want_y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(new_rs, want_rs, rtol=1e-6, atol=1e-6)
    harness.assert_conserved(xs, rs, ys, new_rs)
  assert_traffic(p, d, n, "recursive")


@pytest.mark.parametrize("p,d", harness.grid(
    [(6, 3), (12, 3), (14, 7), (10, 5), (15, 5)],
    [(6, 3), (14, 7), (15, 5)]))  # 3, 7 and 5 teams (B-SAG's odd counts) of 2 and 3
def test_bruck_sag_invariants_model_and_traffic(p, d):
  n = 201  # a small kb keeps the ladder (one compiled branch per h size) short
  used = set()
  for xs, rs, ys, state in run_steps(p, d, "bruck", n, 4, seed=p + d):
    h = np.asarray(state.controller.last_h)
    assert np.all(h == h[0]), "every device must use the same h"
    np.testing.assert_array_equal(np.asarray(state.controller.h),
                                  np.asarray(state.controller.h)[0])
    np.testing.assert_array_equal(ys, np.broadcast_to(ys[0], ys.shape))
    new_rs = np.asarray(state.residual)
    harness.assert_conserved(xs, rs, ys, new_rs)
    want_y, want_rs = reference.spardl(xs, rs, DENSITY, teams=d, sag="bruck", h=int(h[0]))
    np.testing.assert_allclose(ys[0], want_y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(new_rs, want_rs, rtol=1e-6, atol=1e-6)
    used.add(int(h[0]))
  for h in used:
    assert_traffic(p, d, n, "bruck", h)


@pytest.mark.parametrize("p,sag", [(4, "recursive"), (6, "bruck"), (4, "bruck"), (5, "auto")])
def test_every_worker_its_own_team(p, sag):
  n = 151
  kind = cost.sag_kind(p, sag)
  for xs, rs, ys, state in run_steps(p, p, sag, n, 2):
    h = int(np.asarray(state.controller.last_h)[0])
    want_y, want_rs = reference.spardl(xs, rs, DENSITY, teams=p, sag=kind, h=h)
    np.testing.assert_allclose(ys[0], want_y, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(state.residual), want_rs, rtol=1e-6, atol=1e-6)
    harness.assert_conserved(xs, rs, ys, np.asarray(state.residual))


def test_bruck_sag_can_be_forced_for_a_power_of_two():
  xs, rs, ys, state = next(run_steps(8, 4, "bruck", 501, 1))
  h = int(np.asarray(state.controller.last_h)[0])
  assert h == math.ceil(Blocks.make(501, 2, DENSITY).kb / 4)
  want_y, _ = reference.spardl(xs, rs, DENSITY, teams=4, sag="bruck", h=h)
  np.testing.assert_allclose(ys[0], want_y, rtol=1e-6, atol=1e-7)


def test_h_adapts_without_recompiling_and_the_count_settles_near_kb():
  """200 steps of a slowly drifting gradient stream (a shared moving signal plus per-worker
  noise): h moves, the jit cache stays at one entry, and over the last 50 steps the distinct
  count after the cross-team gather stays within 15 % of kb."""
  p, d, n = 6, 3, 6000
  config = SparDLConfig(wire="exact", density=DENSITY, teams=d, sag="bruck")
  kb = Blocks.make(n, p // d, DENSITY).kb
  rng = np.random.default_rng(0)
  phase = rng.uniform(0, 2 * np.pi, n)
  amp = rng.exponential(size=n) ** 2
  state = harness.rows(p, n, config)
  counts, hs, cached = [], set(), []
  for t in range(200):
    xs = amp * np.sin(phase + 0.02 * t) + 0.5 * amp.mean() * rng.standard_normal((p, n))
    # Through jit (not the cached executable), so its cache shows any recompile.
    _, state = jax.block_until_ready(harness.compiled(p, config)(
        harness.put(p, xs.astype(np.float32)), state))
    counts.append(float(np.asarray(state.controller.count)[0]))
    hs.add(int(np.asarray(state.controller.last_h)[0]))
    cached.append(harness.compiled(p, config)._cache_size())
  assert cached[-1] == cached[0], "changing h recompiled"
  assert len(hs) > 3  # h really moved across ladder sizes
  late = np.asarray(counts[-50:]) / kb
  assert late.min() >= 0.85 and late.max() <= 1.15, late


def algorithm2(counts, kb, d):
  """The paper's Algorithm 2, transliterated (plus docs/design.md's clamp of h)."""
  h, step, flag = kb / d, 0.01 * kb * (d - 1) / d, False
  out = []
  for n_t in counts:
    if (n_t > kb) != (step > 0):
      if flag:
        step, flag = step * 2, False
      else:
        flag = True
    else:
      step, flag = -step / 2, False
    h = min(max(h + step, math.ceil(kb / d)), kb)
    out.append((h, step, flag))
  return out


def test_h_controller_follows_algorithm_2_step_by_step():
  kb, d = 1000, 4
  counts = [400, 500, 600, 700, 800, 900, 1100, 1200, 1050, 990, 980, 1010, 1001, 999, 2000,
            3000, 100, 100, 100, 100, 100, 100, 100, 100, 100, 100, 100, 100]
  state = h_controller.start(h_controller.empty(), kb=kb, d=d)
  for count, (h, step, flag) in zip(counts, algorithm2(counts, kb, d)):
    state = h_controller.update(state, jnp.float32(count), kb=kb, d=d)
    np.testing.assert_allclose(float(state.h), h, rtol=1e-5)
    np.testing.assert_allclose(float(state.step), step, rtol=1e-5)
    assert bool(state.flag) == flag
    assert math.ceil(kb / d) <= float(state.h) <= kb


def test_h_ladder_covers_the_range():
  for kb, d in [(1, 3), (13, 3), (100, 7), (18375, 7), (5, 5)]:
    ladder = schedule.h_ladder(kb, d)
    assert ladder[0] == math.ceil(kb / d) and ladder[-1] == kb
    assert all(b > a for a, b in zip(ladder, ladder[1:]))
    assert all(b <= max(a + 1, a * 1.08 + 1) for a, b in zip(ladder, ladder[1:]))


def test_teams_auto_picks_the_modeled_best():
  # Latency-bound (small n, slow alpha): more teams; bandwidth-bound: d = 1 or 2.
  small = cost.choose_teams(16, 10_000, 0.01, alpha=1e-3, beta=1e-10)
  big = cost.choose_teams(16, 100_000_000, 0.01, alpha=1e-6, beta=1e-9)
  assert small > big
  for p, n in [(12, 14_700_000), (14, 14_700_000)]:
    best = cost.choose_teams(p, n, 0.01, **cost.ETHERNET_10G)
    times = {d: cost.modeled_seconds(cost.spardl_cost(p, n, 0.01, d), **cost.ETHERNET_10G)
             for d in range(1, p + 1) if p % d == 0}
    assert times[best] == min(times.values())
  # The config resolves it at trace time and the result is still exact.
  config = SparDLConfig(wire="exact", density=0.2, teams="auto", alpha=1.0, beta=1e-12)
  p, n = 8, 64
  d, kind = allreduce.resolve_teams(config, p, n, 4)
  assert (d, kind) == (8, "recursive")
  xs = harness.gradients(np.random.default_rng(0), p, n)
  ys, rs = harness.run(xs, np.zeros_like(xs), config)
  want_y, want_rs = reference.spardl(xs, np.zeros_like(xs), 0.2, teams=8, sag="recursive")
  np.testing.assert_allclose(ys[0], want_y, rtol=1e-6, atol=1e-7)


def test_sorted_sum_is_the_union_summed_in_row_order():
  """The merge of two ascending rows (R-SAG's and gTopk's pairwise step) against NumPy:
  shared, disjoint and identical offsets, empty slots at the end, an empty row."""
  rng = np.random.default_rng(3)
  merge = jax.jit(sorted_sum)

  def row(pool, filled, size=20):
    offsets = np.full(size, INVALID, np.int32)
    offsets[:filled] = np.sort(rng.choice(pool, filled, replace=False))
    values = np.zeros(size, np.float32)
    values[:filled] = rng.standard_normal(filled)
    return offsets, values

  same = row(40, 20)
  for first, second in [(row(30, 20), row(30, 20)), (row(1000, 20), row(1000, 13)),
                        (same, (same[0], -same[1])), (row(50, 0), row(50, 17)),
                        (row(25, 9), row(25, 0))]:
    got = merge(*first, *second)
    offsets = np.union1d(first[0][first[0] != INVALID], second[0][second[0] != INVALID])
    sums = np.zeros(40, np.float32)
    for off, val in (first, second):  # in row order, as every worker sums
      real = off != INVALID
      sums[np.searchsorted(offsets, off[real])] += val[real]
    want = np.full(40, INVALID, np.int32)
    want[:offsets.size] = offsets
    np.testing.assert_array_equal(np.asarray(got.offsets), want)
    np.testing.assert_array_equal(np.asarray(got.sums), sums)
    assert int(got.count) == offsets.size
