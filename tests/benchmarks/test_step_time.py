"""The train-step benchmark (python -m benchmarks.step_time) on two tiny models: parameters,
bytes per step and a finite loss for each method, and a configuration over the memory limit
listed, not run."""

import json

import numpy as np

from benchmarks import step_time


def test_step_time_reports_both_methods(tmp_path):
  assert step_time.main(["--models", "mlp,bert", "--sizes", "tiny", "--devices", "4",
                         "--steps", "1", "--max-memory-gb", "0.002", "--out", str(tmp_path)]) == 0
  rows = {(r["model"], r["size"], r["method"]): r
          for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
  dense, sparse = rows["mlp", "tiny", "dense"], rows["mlp", "tiny", "spardl"]
  assert dense["params"] == sparse["params"] == 1_210
  assert 0 < sparse["bytes_per_step"] < dense["bytes_per_step"] / 10
  assert dense["step_s"] > 0 and np.isfinite(sparse["loss"])
  # Over 2 MB of replicated state (4 devices x 8 copies): listed, not run.
  assert rows["bert", "tiny", "spardl"]["skipped"].startswith("needs ~")
  assert "| mlp | tiny | 1,210 |" in (tmp_path / "results.md").read_text()
