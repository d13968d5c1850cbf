"""The train-step benchmark (python -m benchmarks.step_time) on two tiny models: parameters,
bytes per step and a finite loss for each method, and a configuration over the memory limit
listed, not run."""

import json

import numpy as np
import pytest

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


def test_every_model_gets_a_batch_of_its_task():
  """A batch for each registered model, its targets shaped for its task: the regression
  teacher's model (no classes) gets targets as wide as its output (the run of 2026-11-28
  stopped there after 27 of 56 configurations)."""
  import models
  for name in models.MODELS:
    model = models.create(name, "tiny")
    x, y, w, task = step_time.synthetic_batch(model, models.spec(name), 3)
    assert len(x) == len(y) == len(w) == 3, name
    assert task in ("classify", "regress", "lm", "mlm"), (name, task)
  x, y, w, task = step_time.synthetic_batch(models.create("dotrelu", "tiny"),
                                            models.spec("dotrelu"), 3)
  assert (task, x.shape, y.shape, w.shape) == ("regress", (3, 1024), (3, 64), (3, 64))
  row = step_time.measure("dotrelu", "tiny", "spardl", devices=2, per_device=4, steps=1)
  assert row["params"] == 77_824 and np.isfinite(row["loss"]) and row["bytes_per_step"] > 0


def test_a_run_stopped_midway_keeps_what_it_measured(tmp_path, monkeypatch):
  """Each configuration's row is written as it ends (with where it was measured): a run that
  fails at the second keeps the first, table and all."""
  measured = []

  def measure(name, size, method, *args):
    if measured:
      raise RuntimeError("stopped")
    measured.append(method)
    return {"model": name, "size": size, "method": method, "params": 1_210, "batch": 8,
            "step_s": 0.5, "bytes_per_step": 100.0}

  monkeypatch.setattr(step_time, "measure", measure)
  with pytest.raises(RuntimeError, match="stopped"):
    step_time.main(["--models", "mlp", "--sizes", "tiny", "--devices", "2", "--out",
                    str(tmp_path)])
  saved = json.loads((tmp_path / "results.json").read_text())
  assert [r["method"] for r in saved["rows"]] == ["dense"] and "commit" in saved
  assert "| mlp | tiny | 1,210 | 8 | 0.5 |" in (tmp_path / "results.md").read_text()
