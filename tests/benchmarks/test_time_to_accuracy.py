"""The time-to-accuracy benchmark's code path, tiny: 2 local processes (gloo over 127.0.0.1,
no namespaces, no shaping), two methods, two evaluations each (benchmarks/results/network.md
has the real run)."""

import json


from benchmarks import runs, time_to_accuracy


def test_smoke_run_reports_every_method(tmp_path, capsys):
  code = time_to_accuracy.main([
      "--local", "--processes", "2", "--rates", "unshaped", "--methods", "dense,spardl",
      "--model-size", "tiny", "--epochs", "2", "--steps-per-epoch", "2", "--targets", "0.1",
      "--out", str(tmp_path)])
  assert code == 0
  rows = json.loads((tmp_path / "results.json").read_text())["rows"]
  assert [(r["rate"], r["method"]) for r in rows] == [("unshaped", "dense"),
                                                       ("unshaped", "spardl")]
  for r in rows:
    assert [len(r["curve"])] == [2] and r["curve"][0][0] < r["curve"][1][0]  # wall clock
    assert r["steps_to_target"] in (2, 4, None) and r["bytes_per_device"] > 0
    assert r["rounds_per_step"] == 2  # P = 2: the ring 2 (P - 1), SparDL 2 ceil(log2 P)
  dense, spardl = rows
  assert spardl["bytes_per_device"] < dense["bytes_per_device"]
  assert (tmp_path / "time_to_accuracy.png").stat().st_size > 0
  assert "| unshaped | dense |" in capsys.readouterr().out
  assert all(r["fraction"] == 0.1 and r["seed"] == 0 for r in rows)
  assert (tmp_path / "seed0" / "unshaped" / "metrics.json").exists()
  # A later run that reads dense's runs from this one (--dense-from) reports the same rows.
  later = tmp_path / "later"
  (later / "seed0" / "unshaped").mkdir(parents=True)
  (later / "seed0" / "unshaped" / "metrics.json").write_text(
      (tmp_path / "seed0" / "unshaped" / "metrics.json").read_text())
  assert time_to_accuracy.main([
      "--report", "--processes", "2", "--rates", "unshaped", "--methods", "spardl",
      "--model-size", "tiny", "--targets", "0.1", "--dense-from", str(tmp_path),
      "--out", str(later)]) == 0
  assert json.loads((later / "results.json").read_text())["rows"] == rows
  # Each experiment's runs folded into one file: the reports read them there, the same.
  assert runs.bundle(str(later)) == 1 and runs.bundle(str(tmp_path)) == 1
  assert not (tmp_path / "seed0").exists() and (tmp_path / runs.BUNDLE).exists()
  for out, methods in ((tmp_path, "dense,spardl"), (later, "spardl")):
    assert time_to_accuracy.main([
        "--report", "--processes", "2", "--rates", "unshaped", "--methods", methods,
        "--model-size", "tiny", "--targets", "0.1", "--out", str(out)]
        + (["--dense-from", str(tmp_path)] if out == later else [])) == 0
    assert json.loads((out / "results.json").read_text())["rows"] == rows


def test_over_seeds_takes_medians_and_counts_who_was_first():
  """Three seeds by hand: a never-reached target counts as infinitely slow in the median."""
  def row(seed, method, seconds, steps):
    return time_to_accuracy.Timed(seed, 0.95, "1gbit", method, 0.9, seconds, steps, seconds,
                                  0.9, 1.0, 0.1, 1)

  rows = [row(0, "a", 10.0, 30), row(0, "b", 5.0, 20), row(1, "a", 4.0, 20),
          row(1, "b", None, None), row(2, "a", 6.0, 40), row(2, "b", 7.0, 10)]
  a, b = time_to_accuracy.over_seeds(rows)
  assert (a.method, a.median_seconds, a.median_steps, a.first) == ("a", 6.0, 30, 2)
  assert (b.method, b.median_seconds, b.median_steps, b.first) == ("b", 7.0, 20, 1)
  assert b.seconds_to_target == [5.0, None, 7.0] and b.seeds == [0, 1, 2]
  never = time_to_accuracy.over_seeds([row(0, "a", None, None), row(1, "a", None, None)])
  assert never[0].median_seconds is None and never[0].first == 0


def test_an_outer_loop_is_charged_its_rounds_once_every_h_steps():
  """The modeled latency: a method's rounds per sync (the ring's 2 (P - 1) at P = 4), over
  H steps for an outer loop."""
  rounds = time_to_accuracy.rounds_per_step(["dense", "dense:outer=10"], 4, "tiny")
  assert rounds == {"dense": 6, "dense:outer=10": 0.6}


def test_the_shapers_record_keeps_the_rates_of_earlier_runs(tmp_path, monkeypatch):
  """A second seed run later at one rate into the same --out keeps the first run's buckets,
  which --report and project --validate read back per rate."""
  from benchmarks import netbench
  monkeypatch.setattr(netbench, "kernel_hz", lambda: 250)
  time_to_accuracy.record_shaper(str(tmp_path), ["100mbit", "1gbit", "unshaped"])
  time_to_accuracy.record_shaper(str(tmp_path), ["100mbit"])
  assert json.loads((tmp_path / time_to_accuracy.SHAPER_FILE).read_text()) == {
      "tbf_burst_bytes": {"100mbit": 50_000, "1gbit": 500_000}}
