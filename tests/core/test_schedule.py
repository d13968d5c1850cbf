"""The static schedules, alone (no JAX)."""

import pytest

from spardl_jax._src.core import schedule


@pytest.mark.parametrize("q", range(1, 34))
def test_srs_sends_every_block_once_and_receives_only_held_blocks(q):
  steps = schedule.srs_schedule(q)
  assert len(steps) == schedule.num_steps(q) == (0 if q == 1 else (q - 1).bit_length())
  for w in range(q):
    held = {(w + j) % q for j in range(q)}   # global blocks, rotated frame
    sent = []
    for st in steps:
      bag = [(w + j) % q for j in range(st.start, st.stop)]
      assert set(bag) <= held
      held -= set(bag)
      sent += bag
      # Paper's Theorem 1: the bag received from w - shift is a subset of what w still holds.
      source = (w - st.shift) % q
      incoming = {(source + j) % q for j in range(st.start, st.stop)}
      assert incoming <= held
    assert held == {w}
    assert sorted(sent) == sorted(set(range(q)) - {w})


def test_srs_matches_the_papers_six_worker_example():
  # Paper, Example 2 (1-based workers): worker 1 sends 2 blocks at distance 4, 2 at
  # distance 2 and 1 at distance 1.
  steps = schedule.srs_schedule(6)
  assert [(s.shift, s.size) for s in steps] == [(4, 2), (2, 2), (1, 1)]
  assert [(0 + j) % 6 for j in range(steps[0].start, steps[0].stop)] == [4, 5]


@pytest.mark.parametrize("q", range(1, 34))
def test_bruck_gathers_every_block_once(q):
  have = {w: [w] for w in range(q)}
  for st in schedule.bruck_schedule(q):
    sent = {w: have[w][:st.count] for w in range(q)}
    for w in range(q):
      have[w] = have[w] + sent[(w + st.shift) % q]
  for w in range(q):
    assert have[w] == [(w + j) % q for j in range(q)]
  assert sum(st.count for st in schedule.bruck_schedule(q)) == q - 1


def test_team_permutation_stays_inside_contiguous_teams():
  pairs = schedule.team_permutation(6, 3, 1)
  assert pairs == [(0, 1), (1, 2), (2, 0), (3, 4), (4, 5), (5, 3)]
  assert schedule.team_permutation(4, 4, -1) == [(0, 3), (1, 0), (2, 1), (3, 2)]
  with pytest.raises(ValueError, match="does not divide"):
    schedule.team_permutation(6, 4, 1)


def test_cli_prints_schedule(capsys):
  assert schedule.main(["6"]) == 0
  out = capsys.readouterr().out
  assert "worker 1 -> worker 5: blocks [5, 0]" in out
  assert "3 SRS + 3 Bruck rounds" in out
  assert schedule.main(["zero"]) == 2
