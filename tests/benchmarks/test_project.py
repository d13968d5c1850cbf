"""The projection tool's arithmetic against cases computed by hand from the paper's cost
table (Table 1: SparDL's 2 log2 P rounds and 4 kb (P - 1) words; the ring all-reduce's
2 (P - 1) rounds and 2 (P - 1) / P n words), and its validation against a netbench run."""

import pytest

from spardl_jax._src.sync import registry as methods
from benchmarks import netbench, project

N, P = 14_700_000, 8
ETHERNET = project.LINKS["10gbe"]  # 50 us a round, 1.25 GB/s


def test_spardl_and_dense_on_10gbe_by_hand():
  kb = 18_375  # ceil(0.01 * 14.7M / 8)
  spardl = methods.make("spardl", density=0.01, wire="exact")
  # 6 rounds; 4 kb (P - 1) = 514,500 four-byte words.
  want = 0.002 + 6 * 50e-6 + 4 * kb * 7 * 4 / 1.25e9
  assert project.sync_seconds(spardl, p=P, n=N, link=ETHERNET, compute_s=0.002) == \
      pytest.approx(want, rel=1e-12)
  dense = methods.make("dense")
  want = 14 * 50e-6 + 2 * 7 / 8 * N * 4 / 1.25e9  # 0.0830 s
  assert project.sync_seconds(dense, p=P, n=N, link=ETHERNET, compute_s=0.0) == \
      pytest.approx(want, rel=1e-12)
  assert project.step_seconds(dense, p=P, n=N, link=ETHERNET, compute_s=0.0,
                              step_s=0.0041) == pytest.approx(0.0041 + want, rel=1e-12)


def test_the_token_bucket_lets_the_first_bytes_through():
  link = project.Link(0.0, 8 / 100e6, project.OLD_TBF_BURST)
  compact = methods.make("spardl", density=0.01)  # 1,029,812 bytes: inside the 4 MiB bucket
  assert project.sync_seconds(compact, p=P, n=N, link=link, compute_s=0.4) == 0.4
  dense = methods.make("dense")  # 88.2 MB at P = 4, 4 MiB of it at once
  assert project.sync_seconds(dense, p=4, n=N, link=link, compute_s=0.35) == pytest.approx(
      0.35 + (88_200_000 - 4 * 2**20) * 8 / 100e6, rel=1e-12)


def test_validation_predicts_each_shaped_time_from_the_unshaped_one():
  results = {"unshaped": {"dense": {"seconds": 0.35}, "spardl": {"seconds": 0.40}},
             "100mbit": {"dense": {"seconds": 7.26}, "spardl": {"seconds": 0.486}}}
  rows = {r["method"]: r for r in project.validate(results, p=4, n=N, density=0.01)}
  assert rows["dense"]["predicted_s"] == pytest.approx(0.35 + (88_200_000 - 4 * 2**20) * 8e-8)
  assert rows["spardl"]["predicted_s"] == 0.40
  assert rows["spardl"]["error"] == pytest.approx(0.40 / 0.486 - 1)
  with pytest.raises(ValueError, match="needs a netbench run with the rate 'unshaped'"):
    project.validate({"1gbit": {}}, p=4, n=N, density=0.01)


def test_a_run_that_records_its_buckets_is_charged_every_byte_past_each():
  """netbench's results since it paces every byte: each rate's bucket, one timer tick of it
  (rate / HZ), recorded beside the rates. SparDL's 882,684 bytes at P = 4 (its formula; inside
  the old 4 MiB bucket) are charged all but 50,000 bytes at 100 Mbit/s and all but 500,000 at
  1 Gbit/s (HZ = 250); a run that recorded one bucket for every rate is charged that one."""
  results = {"unshaped": {"spardl": {"seconds": 0.40}},
             "100mbit": {"spardl": {"seconds": 0.50}},
             "1gbit": {"spardl": {"seconds": 0.45}},
             "shaper": {"tbf_burst_bytes": {"100mbit": 50_000, "1gbit": 500_000}}}
  rows = {r["rate"]: r["predicted_s"] for r in project.validate(results, p=4, n=N, density=0.01)}
  assert rows == pytest.approx({"100mbit": 0.40 + (882_684 - 50_000) * 8 / 100e6,
                                "1gbit": 0.40 + (882_684 - 500_000) * 8 / 1e9})
  results["shaper"] = {"tbf_burst_bytes": 16 * 1024}
  rows = {r["rate"]: r["predicted_s"] for r in project.validate(results, p=4, n=N, density=0.01)}
  assert rows["100mbit"] == pytest.approx(0.40 + (882_684 - 16 * 1024) * 8 / 100e6)


def test_the_shapers_bucket_is_one_timer_tick_of_its_rate(monkeypatch):
  """tc's manual: a bucket under rate / HZ loses the tokens that arrive between ticks."""
  assert netbench.kernel_hz() in (100, 250, 300, 1000)  # Linux's choices; 100 if unreadable
  monkeypatch.setattr(netbench, "kernel_hz", lambda: 250)
  assert netbench.rate_bits("100mbit") == 100e6 and netbench.rate_bits("2.5gbit") == 2.5e9
  assert netbench.tbf_burst("100mbit") == 50_000       # 12.5 MB/s for 4 ms
  assert netbench.tbf_burst("1gbit") == 500_000
  assert netbench.tbf_burst("10mbit") == 16 * 1024     # a tick's 5,000 bytes: the floor
  assert netbench.shaper_record(["unshaped", "1gbit"]) == {"tbf_burst_bytes": {"1gbit": 500_000}}


def test_per_step_validation_charges_each_run_its_own_bytes():
  """A time-to-accuracy run: 20 epochs of 11 steps; dense sent 26.1 MB a step (5.742 GB in
  220 steps), of which all but the 4 MiB bucket waits for 100 Mbit/s."""
  tta = {"args": {"epochs": 20, "steps_per_epoch": 11}, "rows": [
      {"seed": seed, "rate": rate, "method": "dense", "seconds_per_step": s,
       "bytes_per_device": 5_742e6}
      for seed, rate, s in ((0, "unshaped", 0.207), (0, "100mbit", 2.176), (1, "100mbit", 9.9))]}
  steps = project.per_step(tta, seed=0)
  assert steps == {"unshaped": {"dense": {"seconds": 0.207, "bytes": 5_742e6 / 220}},
                   "100mbit": {"dense": {"seconds": 2.176, "bytes": 5_742e6 / 220}},
                   "shaper": {"tbf_burst_bytes": 4 * 2**20}}  # run before it was recorded
  (row,) = project.validate(steps, p=4, n=N, density=0.01)
  assert row["predicted_s"] == pytest.approx(0.207 + (5_742e6 / 220 - 4 * 2**20) * 8 / 100e6)
  assert row["error"] == pytest.approx(row["predicted_s"] / 2.176 - 1)


def test_projection_rows_and_the_paper_scaling():
  rows = project.project(n=N, density=0.01, compute_ms={"spardl": 2.2, "dense": 0.07},
                         step_ms=4.1, links=["100mbit"], ps=[2, 1024])
  by = {(r["method"], r["p"]): r["step_s"] for r in rows}
  # Dense's bytes approach 2n words as P grows; SparDL's stay near 4 k words (k = 1 % of n).
  assert by[("dense", 1024)] > 1.9 * by[("dense", 2)]
  assert by[("spardl", 1024)] < by[("dense", 1024)] / 10


@pytest.mark.parametrize("flags, message", [
    (["--links", "5g"], "--links: unknown '5g'"),
    (["--compute", "spardl=x"], "give method=milliseconds pairs"),
    (["--compute", "spardl=-1"], "the milliseconds must be >= 0"),
    (["--p", "0,8"], "--p must be >= 1"),
    (["--compute", "nosuch=1"], "the method must be one of"),
    (["--validate", "/nonexistent/results.json"],
     "--validate '/nonexistent/results.json' cannot be read: No such file or directory"),
    (["--validate", __file__], "is not a results.json"),
])
def test_bad_flags(capsys, flags, message):
  with pytest.raises(SystemExit) as exit_:
    project.main(flags)
  assert exit_.value.code == 2 and message in capsys.readouterr().err
