"""Every driver and script of benchmarks/ runs on a tiny case, so none can rot unnoticed
(time_to_accuracy, scale, project and step_time have their own test files). What each prints
is checked against what it must contain; the figures themselves are benchmarks, not tests."""

import json
import pathlib
import re
import subprocess

import numpy as np
import pytest

from benchmarks import (convergence, floor_cpu, netbench, outer_sync_time, paper_compare,
                        per_rank, sharded_step, staleness, sync_profile, versus, vgg16_compute)
from benchmarks.runs import Row, Runs

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "benchmarks" / "scripts").glob("*.sh"))


def test_convergence_trains_a_case_and_reports_it_again(tmp_path, capsys):
  out = tmp_path / "cv"
  assert convergence.main(["--cases", "mnist1d_cnn1d", "--variants", "dense,recipe",
                           "--seeds", "0", "--epochs", "2", "--steps-per-epoch", "2",
                           "--devices", "2", "--out", str(out)]) == 0
  rows = json.loads((out / "results.json").read_text())["rows"]
  assert [r["key"] for r in rows] == ["dense", "recipe"]
  assert rows[1]["bytes_per_step"] < rows[0]["bytes_per_step"] / 10
  assert all(len(r["curves"][0]) == 2 for r in rows)  # one point per evaluation
  # --report reads the results back at another target: the same runs, the same curves.
  again = tmp_path / "again"
  assert convergence.main(["--report", str(out), "--target", "0.5", "--out", str(again)]) == 0
  rows_again = json.loads((again / "results.json").read_text())["rows"]
  assert [r["curves"] for r in rows_again] == [r["curves"] for r in rows]
  assert {r["fraction"] for r in rows_again} == {0.5}
  assert "| mnist1d_cnn1d | dense |" in capsys.readouterr().out


def test_netbench_times_every_method_over_local_processes(tmp_path, capsys):
  assert netbench.main(["--local", "--processes", "2", "--rates", "unshaped", "--n", "4000",
                        "--repeats", "1", "--methods", "dense,spardl",
                        "--out", str(tmp_path)]) == 0
  results = json.loads((tmp_path / "results.json").read_text())["unshaped"]
  assert results["dense"]["bytes"] == 2 * (2 - 1) * 4000 * 4 // 2  # the ring at P = 2
  assert 0 < results["spardl"]["bytes"] < results["dense"]["bytes"] / 10
  assert all(r["seconds"] > 0 for r in results.values())
  assert "| spardl |" in capsys.readouterr().out


def test_netbench_local_cannot_shape(capsys):
  with pytest.raises(SystemExit):
    netbench.main(["--local", "--rates", "100mbit"])
  assert "--local cannot shape the network" in capsys.readouterr().err


def test_outer_sync_time_runs_every_variant(capsys):
  assert outer_sync_time.main(["--n", "1000", "--steps", "1"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert [line.rsplit(" [", 1)[0] for line in lines] == list(outer_sync_time.RUNS)


def test_paper_compare_prints_a_row_per_reported_speedup(capsys):
  assert paper_compare.main() == 0
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
  assert len(rows) == 2 + sum(len(case[-1]) for case in paper_compare.CASES)
  assert all(re.search(r"\d×", row) for row in rows[2:])


def test_sharded_step_reads_bytes_and_times_each_variant(tmp_path, capsys):
  assert sharded_step.main(["--steps", "1", "--out", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  raw = json.loads((tmp_path / "results.json").read_text())
  assert [r["variant"] for r in raw["rows"]] == [
      "SparDL 1 %, sharded (4 x 2)", "SparDL 1 %, replicated (8)", sharded_step.DENSE]
  assert raw["commit"] and raw["args"]["steps"] == 1
  assert (tmp_path / "results.md").read_text() == sharded_step.format_table(raw["rows"]) + "\n"
  assert all(r["permuted"] > 0 for r in raw["rows"][:2]) and raw["rows"][2]["permuted"] == 0
  for name in ("SparDL 1 %, sharded (4 x 2)", "SparDL 1 %, replicated (8)",
               "dense jit, sharded (4 x 2)"):
    assert f"{name}: permutes send" in out
    assert re.search(rf"{re.escape(name)}: [\d.]+ ms/step", out)


def test_sync_compute_per_rank_on_a_small_model(tmp_path, capsys):
  out = tmp_path / "compute.json"
  assert vgg16_compute.main(["--model", "mlp", "--repeats", "1", "--out", str(out)]) == 0
  saved = json.loads(out.read_text())
  assert set(saved["per_rank_s"]) == {"dense", "spardl", "oktopk", "powersgd"}
  assert saved["model"] == "mlp" and all(s > 0 for s in saved["per_rank_s"].values())


def test_one_rank_replayed_gives_the_batched_result(tmp_path, capsys):
  """Rank 0's program with every collective replaced by what it returned in the batched
  run computes the batched run's result bit for bit, for a one-collective and a
  six-collective method."""
  out = tmp_path / "per_rank.json"
  assert per_rank.main(["--ranks", "4", "--n", "4000", "--methods", "dense,spardl",
                        "--repeats", "1", "--out", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [(r["method"], r["collectives"], r["same_result"]) for r in rows] == [
      ("dense", 1, True), ("spardl", 2 * 2, True)]  # SRS and Bruck: log2 4 rounds each
  assert all(r["one_rank_s"] > 0 and r["batched_per_rank_s"] > 0 for r in rows)


def test_the_profile_charges_spardls_stages(capsys):
  rows, total = sync_profile.profile("spardl", p=4, n=40_000, calls=1)
  stages = {stage for stage, _, _ in rows}
  assert {"spar_reduce_scatter", "scatter_result"} <= stages
  assert total > 0 and abs(sum(us for *_, us in rows) - total) < 1e-6 * total


def test_the_profile_compares_files_side_by_side(tmp_path, capsys):
  """--compare sums each file's stages into one column (a fused span charged to its first
  stage) and runs nothing; a pair without '=' is refused by name."""
  one = {"total_us": 3000.0, "rows": [
      {"stage": "spar_reduce_scatter", "module": "srs.py", "us": 2000.0},
      {"stage": "_stages + spar_reduce_scatter", "module": "allreduce.py", "us": 1000.0}]}
  two = {"total_us": 1000.0, "rows": [{"stage": "_stages", "module": "allreduce.py",
                                       "us": 1000.0}]}
  for name, raw in (("a", one), ("b", two)):
    (tmp_path / f"{name}.json").write_text(json.dumps(raw))
  assert sync_profile.main(["--compare", f"x={tmp_path / 'a.json'},y={tmp_path / 'b.json'}"]) == 0
  assert capsys.readouterr().out.splitlines()[2:] == [
      "| spar_reduce_scatter | 3.0 | 0.0 |", "| _stages | 0.0 | 1.0 |", "| in all | 3.0 | 1.0 |"]
  with pytest.raises(SystemExit):
    sync_profile.main(["--compare", str(tmp_path / "a.json")])
  assert "LABEL=FILE" in capsys.readouterr().err


def test_versus_times_both_versions_of_each_method(capsys):
  """The library against itself at HEAD (any commit a clone has): each method twice, beside
  psum."""
  assert versus.main(["--against", "HEAD", "--devices", "2", "--n", "1e4", "--methods",
                      "dense,spardl", "--repeats", "1"]) == 0
  out = capsys.readouterr().out
  for label in ("psum", "dense (now)", "dense (HEAD)", "spardl (now)", "spardl (HEAD)"):
    assert f"| {label} |" in out


def test_the_cpu_floor_times_its_three_programs(capsys):
  assert floor_cpu.main(["--devices", "4", "--n", "1e4", "--repeats", "1", "--methods",
                         "spardl"]) == 0
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
  assert [row.split(" | ")[0] for row in rows[1:]] == [  # after the header
      "| psum", "| stream x, r in; result, residual out",
      "| the same + 4 rounds of a 1 % message", "| spardl"]


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_scripts_parse_and_name_what_exists(script):
  """Each shell script is valid bash, and every module it runs with ``python -m`` and every
  file under benchmarks/ it names exists (a rename cannot leave one behind)."""
  subprocess.run(["bash", "-n", str(script)], check=True)
  text = script.read_text()
  ours = ("benchmarks", "train", "spardl_jax", "models")
  for module in (m for m in re.findall(r"python3? -m ([\w.]+)", text)
                 if m.split(".")[0] in ours):
    path = ROOT / module.replace(".", "/")
    assert path.with_suffix(".py").exists() or (path / "__main__.py").exists(), module
  for name in re.findall(r"benchmarks/[\w/]+\.(?:py|sh|json)", text):
    assert (ROOT / name).exists(), name


def test_staleness_lag_is_zero_when_everything_is_sent_and_grows_as_less_is(capsys):
  assert staleness.lag("spardl", 4, 1.0, n=64, steps=4)[0] == pytest.approx(0, abs=1e-6)
  assert 0 < staleness.lag("spardl", 4, 0.1, n=256, steps=8)[0] < 1
  assert staleness.main(["--p", "2,4", "--densities", "0.1", "--n", "64", "--steps", "4"]) == 0
  rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| spardl")]
  assert len(rows) == 1 and rows[0].count("|") == 5


def test_a_loss_target_is_reached_at_or_below_it():
  """--on loss: the target is dense's mean final test loss times 2 - fraction, and a run
  reaches it at its first evaluation at or below it (hand-made curves: steps, bytes, metric,
  loss)."""
  dense = [[(10, 100, 0.3, 2.5), (20, 200, 0.4, 2.0)], [(10, 100, 0.3, 2.6), (20, 200, 0.4, 2.2)]]
  sparse = [[(10, 5, 0.3, 2.2), (20, 10, 0.4, 2.1)], [(10, 5, 0.3, 2.5), (20, 10, 0.4, 2.15)]]
  rows = convergence.rows_at("case", {
      key: Runs("case", key, key, "accuracy", 1.0, curves)
      for key, curves in (("dense", dense), ("sparse", sparse))}, 0.98, "loss")
  target = 1.02 * 2.1  # 2.142
  assert {r.target for r in rows} == {target}
  assert rows[0].steps == [20, None]  # 2.2 > 2.142: the second dense seed never gets there
  assert rows[1].steps == [20, None] and rows[1].final == [2.1, 2.15]
  assert rows[1].on == "loss" and rows[1].metric == "accuracy"
  assert rows[1].bytes_per_step == 0.5  # each device's mean over the run: 10 B in 20 steps
  assert "of dense's final test loss" in convergence.format_table(rows)


def test_a_report_joins_one_variants_seeds_from_several_directories(tmp_path):
  """--report over directories that hold different seeds of one variant gives one row with
  every seed, a seed two directories share (dense's, run once and read twice) counted once,
  and one key at two labels (DiLoCo at two H) two rows; a list of targets adds a table of
  each row's steps to each."""
  def run(name, seeds, runs):
    (tmp_path / name).mkdir()
    rows = [{"case": "c", "key": k, "variant": label, "metric": "accuracy",
             "bytes_per_step": 4.0, "curves": curves} for k, label, curves in runs]
    (tmp_path / name / "results.json").write_text(json.dumps({"seeds": seeds, "rows": rows}))
    return str(tmp_path / name)
  dense = ("dense", "dense", [[[10, 40.0, 0.5, 2.0]], [[10, 40.0, 0.5, 2.0]]])
  first = run("a", [0, 1], [dense, ("v", "v at 10",
                                    [[[10, 4.0, 0.5, 2.4]], [[10, 4.0, 0.5, 2.3]]])])
  more = run("b", [1, 2], [dense[:2] + ([dense[2][0], [[10, 40.0, 0.5, 2.0]]],),
                           ("v", "v at 10", [[[10, 4.0, 0.5, 2.3]], [[10, 4.0, 0.5, 2.0]]]),
                           ("v", "v at 30", [[[10, 4.0, 0.5, 1.0]], [[10, 4.0, 0.5, 1.0]]])])
  assert convergence.main(["--report", f"{first},{more}", "--on", "loss", "--target",
                           "0.98,0.5", "--out", str(tmp_path / "t")]) == 0
  rows = json.loads((tmp_path / "t" / "results.json").read_text())["rows"]
  assert [(r["variant"], r["seeds"], r["final"]) for r in rows] == [
      ("dense", [0, 1, 2], [2.0, 2.0, 2.0]), ("v at 10", [0, 1, 2], [2.4, 2.3, 2.0]),
      ("v at 30", [1, 2], [1.0, 1.0])]
  table = (tmp_path / "t" / "results.md").read_text()
  assert "| steps to 102% (per seed) | × dense | steps to 150% (per seed) | × dense |" in table
  assert "| c | v at 10 | never (never, never, 10) | – | 10 (10, 10, 10) | 1.00 |" in table


def test_a_report_of_several_cases_sets_the_variants_side_by_side():
  """Several cases give one line per variant (joined on its key, each case's label kept), a
  cell per case of its final loss, that over dense's and dense's bytes over its; the best
  under half of dense's bytes bold (bfloat16-like halves are not), a diverged run said so, a
  case that did not run the variant left empty."""
  def row(case, key, label, finals, sent):
    return Row(case, key, label, "accuracy", [None] * len(finals), finals, sent, on="loss")
  rows = [row("a", "dense", "dense", [2.0, 2.0], 100.0), row("a", "half", "half", [2.0], 50.0),
          row("a", "s", "s (5 steps)", [2.2, 2.6], 10.0), row("a", "t", "t", [2.5], 20.0),
          row("b", "dense", "dense", [1.0], 80.0), row("b", "s", "s (9 steps)", [np.inf], 8.0)]
  assert convergence.pivot_table(rows).splitlines() == [
      "| key | variant (final test loss · × dense's · dense ÷ bytes a step) | a | b |",
      "| --- | --- | --- | --- |",
      "| `dense` | dense | 2.000 (2.000, 2.000) · 1.00 · 1.0 | 1.000 · 1.00 · 1.0 |",
      "| `half` | half | 2.000 · 1.00 · 2.0 |  |",
      "| `s` | s (5 steps) / s (9 steps) | **2.400** (2.200, 2.600) · 1.20 · 10.0 | "
      "diverged · – · 10.0 |",
      "| `t` | t | 2.500 · 1.25 · 5.0 |  |"]


def test_a_report_of_several_cases_lists_each_cases_settings_as_its_runs_recorded_them():
  """The cases table: the settings a run recorded (nanoGPT's whole AdamW recipe in words),
  else the case's definition now, said under the table; steps and dense's finals from the
  curves."""
  curve = lambda final: [[100, 1.0, 0.5, 2.0], [2000, 2.0, 0.5, final]]  # noqa: E731
  rows = [Row(c, "dense", "dense", "accuracy", [None] * len(finals), finals, 1.0, on="loss",
              curves=[curve(f) for f in finals])
          for c, finals in (("shakespeare_nanogpt", [1.5, 1.7]), ("digits_resnet20", [0.5]))]
  recorded = {"shakespeare_nanogpt": {**convergence.case_configs(["shakespeare_nanogpt"])[
      "shakespeare_nanogpt"], "lr": 3e-4}}
  assert convergence.cases_table(rows, recorded).splitlines() == [
      "| case | model | data | optimizer | steps | dense's final test loss (per seed) |",
      "| --- | --- | --- | --- | ---: | --- |",
      "| `shakespeare_nanogpt` | nanogpt full | shakespeare, batch 96 × 64 | adamw lr 0.0003, "
      "b2 0.99, weight decay 0.1 (matrices), cosine after 100 warm-up steps to 0.1×, clip 1 | "
      "2,000 | 1.600 (1.500, 1.700) |",
      "| `digits_resnet20` | resnet20 full | digits, batch 64 | sgd lr 0.05, momentum 0.9 | "
      "2,000 | 0.500 (0.500) |",
      "",
      "Settings of `digits_resnet20`: as `benchmarks/convergence.py` defines the case now (its "
      "runs predate the record)."]


def test_the_goals_table_judges_each_variant_against_dense():
  """--goals: steps over dense's (and over tuned dense's), the final within FINAL points of
  dense's (a metric) or FINAL of its loss, dense's bytes a step over the variant's from the
  curves (the run's mean, a warm-up included, whatever ``bytes_per_step`` says); missed in
  bold, a variant that never reaches the target missed with its seeds, dense that never
  does said so."""
  def run(key, curves, label=None):
    return Runs("case", key, label or key, "accuracy", 1.0, curves)
  dense = [[(10, 1000, 0.5, 2.0), (20, 2000, 0.8, 1.0)]]
  rows = convergence.rows_at("case", {
      "dense": run("dense", dense),
      "dense_tuned": run("dense_tuned", [[(10, 1000, 0.8, 1.0), (20, 2000, 0.8, 1.0)]],
                         "tuned"),
      "good": run("good", [[(10, 10, 0.5, 2.0), (20, 100, 0.797, 1.0)]]),
      "slow": run("slow", [[(10, 500, 0.5, 2.0), (20, 600, 0.7, 1.0)]])}, 0.95)
  goals = convergence.Goals(steps=1.25, final=0.005, fewer_bytes=10)
  assert convergence.goals_table(rows, goals).splitlines() == [
      "| case | variant | steps to target ÷ dense's (≤ 1.25) | final test accuracy (within "
      "0.5 points of dense's) | dense's bytes a step ÷ its (≥ 10) |",
      "| --- | --- | --- | --- | --- |",
      "| case | tuned | met: 0.50 (1.00 over the best dense's) | met: 0.800 against 0.800 "
      "(+0.0 points) | **missed**: 1.0 |",
      "| case | good | met: 1.00 (2.00 over the best dense's) | met: 0.797 against 0.800 "
      "(-0.3 points) | met: 20.0 |",
      "| case | slow | **missed**: never (never) | **missed**: 0.700 against 0.800 (-10.0 "
      "points) | **missed**: 3.3 |"]
  loss = convergence.rows_at("case", {"dense": run("dense", dense),
                                      "v": run("v", [[(10, 10, 0.5, 1.01), (20, 20, 0.5, 1.03)]])},
                             0.98, "loss")
  assert convergence.goals_table(loss, convergence.Goals(1.25, 0.02, 15), ["v"]).splitlines()[
      2:] == ["| case | v | met: 0.50 | **missed**: 1.030 against 1.000 (+3.0 %) | met: 100.0 |"]


def test_the_labs_readme_lists_every_driver_script_and_page():
  """benchmarks/README.md names every driver (a module with a main), every script and every
  results page, so a reader finds each from one place."""
  readme = (ROOT / "benchmarks" / "README.md").read_text()
  drivers = [p.stem for p in (ROOT / "benchmarks").glob("*.py")
             if re.search(r"^def main\(", p.read_text(), re.M)]
  assert len(drivers) > 10
  missing = ([d for d in drivers if f"python -m benchmarks.{d}`" not in readme
              and f"python -m benchmarks.{d} " not in readme]
             + [s.name for s in SCRIPTS if f"`scripts/{s.name}" not in readme]
             + [p.name for p in (ROOT / "benchmarks" / "results").glob("*.md")
                if f"(results/{p.name})" not in readme])
  assert missing == []
