"""The time-to-accuracy benchmark's code path, tiny: 2 local processes (gloo over 127.0.0.1,
no namespaces, no shaping), two methods, two evaluations each (docs/network.md has the real
run)."""

import json

import pytest

from train import time_to_accuracy


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
  assert all(r["fraction"] == 0.1 for r in rows)


def test_bad_flags_are_named():
  with pytest.raises(SystemExit):
    time_to_accuracy.main(["--local", "--rates", "100mbit"])  # --local cannot shape
  with pytest.raises(SystemExit):
    time_to_accuracy.main(["--methods", "spardl"])  # dense sets the target
  with pytest.raises(SystemExit):
    time_to_accuracy.main(["--targets", "0.9,1.5"])
