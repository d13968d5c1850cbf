"""Time to accuracy against P (`python -m benchmarks.scale`): steps to the target read from run
files, times the projected step computed by hand from the paper's cost table (SparDL's
2 log2 P rounds and 4 kb (P - 1) words, the ring's 2 (P - 1) rounds and 2 (P - 1) / P n
words); "never", lower bounds, the best density and the crossover."""

import json
import shutil

import pytest

from benchmarks import runs as lab_runs
from benchmarks import scale
from benchmarks.runs import RowAtP

SHAPES = [(1000, 147)]  # n = 147,000
N = 147_000
ETHERNET = (50e-6, 8 / 10e9)  # 10 GbE: alpha, beta
PROJECTION = {"args": {"compute": {"dense": 0.0, "spardl": 2.0, "topka": 1.0}, "step_ms": 4.0,
                       "links": "10gbe"}}


def write_run(folder, p, seed, variants):
  """A `python -m train` metrics.json: variants = [(label, method, options, accuracies)],
  one test accuracy per epoch of 10 steps."""
  folder.mkdir(parents=True)
  run = {"config": {"devices": p, "seed": seed,
                    "variants": [{"label": label, "method": method, "options": options}
                                 for label, method, options, _ in variants]},
         "runs": [{"method": label, "metric": "accuracy", "num_params": N,
                   "bytes_per_step": 0.0, "time_per_step": 0.0,
                   "history": [{"steps": 10 * (i + 1), "test_accuracy": a}
                               for i, a in enumerate(accuracies)]}
                  for label, *_, accuracies in variants]}
  (folder / "metrics.json").write_text(json.dumps(run))


def spardl(p, density):
  kb = -(-round(density * N) // p)  # the paper's kb = k / P, k = density n
  alpha, beta = ETHERNET
  rounds = 2 * (p - 1).bit_length()
  return 4e-3 + 2e-3 + rounds * alpha + 4 * kb * (p - 1) * 4 * beta  # exact wire: 4-byte words


def dense(p):
  alpha, beta = ETHERNET
  return 4e-3 + 2 * (p - 1) * alpha + 2 * (p - 1) / p * N * 4 * beta


@pytest.fixture
def runs(tmp_path):
  exact = {"wire": "exact"}
  for seed, late in ((0, 0.96), (1, 0.97)):
    write_run(tmp_path / f"s{seed}_p8", 8, seed, [
        ("dense", "dense", {}, [0.5, 0.9, 0.95, late]),
        ("spardl", "spardl", {"density": 0.01, **exact}, [0.4, 0.8, 0.95, 0.96]),
        ("spardl:density=0.05", "spardl", {"density": 0.05, **exact}, [0.5, 0.95, 0.96, 0.96]),
        ("topka", "topka", {"density": 0.01}, [0.3, 0.5, 0.6, 0.7])])
  write_run(tmp_path / "s0_p16", 16, 0, [
      ("dense", "dense", {}, [0.5, 0.9, 0.95, 0.96]),
      ("spardl", "spardl", {"density": 0.01, **exact}, [0.4, 0.8, 0.9, 0.95]),
      ("topka", "topka", {"density": 0.01}, [0.5, 0.95, 0.96, 0.96]),
      ("gtopk", "gtopk", {"density": 0.01}, [0.5, 0.95, 0.96, 0.96])])
  # dense again beside another variant: its first run counts, not this one.
  write_run(tmp_path / "s0_p16_more", 16, 0, [("dense", "dense", {}, [0.1, 0.2, 0.3, 0.99])])
  return tmp_path


def test_steps_to_the_target_per_p(runs):
  rows = {(r.p, r.key): r for r in scale.steps_table(scale.load_runs([str(runs)]), 0.98)}
  # P = 8: dense ends at 0.96 and 0.97 (seeds 0, 1): the target is 0.98 * 0.965 = 0.9457.
  assert rows[8, "dense"].target == pytest.approx(0.98 * 0.965)
  assert rows[8, "dense"].steps == [30, 30] and rows[8, "spardl"].steps == [30, 30]
  assert rows[8, "spardl:density=0.05"].mean_steps == 20
  assert rows[8, "spardl:density=0.05"].steps_ratio == pytest.approx(20 / 30)
  assert rows[8, "topka"].steps == [None, None] and rows[8, "topka"].mean_steps is None
  assert rows[16, "dense"].final == [0.96]  # the first run of dense at P = 16
  assert rows[16, "spardl"].mean_steps == 40 and rows[16, "topka"].mean_steps == 20


def test_time_to_target_by_hand_best_density_and_crossover(runs):
  steps = scale.steps_table(scale.load_runs([str(runs)]), 0.98)
  times = {(r["p"], r["key"]): r for r in scale.time_rows(steps, PROJECTION, SHAPES)}
  assert times[8, "dense"]["seconds"] == pytest.approx(30 * dense(8), rel=1e-9)
  assert times[8, "spardl"]["seconds"] == pytest.approx(30 * spardl(8, 0.01), rel=1e-9)
  assert times[8, "spardl:density=0.05"]["seconds"] == pytest.approx(20 * spardl(8, 0.05),
                                                                     rel=1e-9)
  assert times[16, "spardl"]["seconds"] == pytest.approx(40 * spardl(16, 0.01), rel=1e-9)
  assert times[8, "topka"]["seconds"] is None
  assert times[16, "gtopk"]["lower_bound"] and not times[16, "topka"]["lower_bound"]
  firsts = {f["p"]: f for f in scale.first_rows(list(times.values()))}
  # P = 8: 5 % reaches the target in 20 steps, 1 % in 30; TopkA never does.
  assert firsts[8]["best"]["spardl"] == (pytest.approx(20 * spardl(8, 0.05)), 0.05)
  assert firsts[8]["fixed"]["spardl"][0] == pytest.approx(30 * spardl(8, 0.01))
  assert firsts[8]["fixed"]["topka"] == (None, 0.01)
  # At 1 % dense is first (30 steps of 5.5 ms against 30 of 6.3 ms); at 5 % SparDL (20 steps).
  assert 30 * dense(8) < 30 * spardl(8, 0.01) and 20 * spardl(8, 0.05) < 30 * dense(8)
  assert firsts[8]["first_fixed"] == "dense" and firsts[8]["first_best"] == "spardl"
  # P = 16: TopkA (20 steps) is first of the measured; gTopk, projected without a compute,
  # beats it unless each of its 20 syncs computes longer than their difference.
  alpha, beta = ETHERNET
  topka = 4e-3 + 1e-3 + 4 * alpha + 15 * 1470 * 8 * beta  # log2 16 rounds, (P - 1) k pairs
  gtopk = 4e-3 + 8 * alpha + 4 * 1470 * 8 * beta  # 2 log2 16 rounds; rank 0: 4 tree edges
  assert firsts[16]["first_best"] == "topka"
  assert firsts[16]["contenders_best"] == {"gtopk": pytest.approx((topka - gtopk) * 1e3)}
  assert scale.crossover(list(firsts.values()), "best") == {"10gbe": None}  # TopkA at 16
  assert scale.crossover([firsts[8]], "best") == {"10gbe": 8}
  assert scale.crossover([firsts[8]], "fixed") == {"10gbe": None}


def test_steps_against_p_without_a_projection(runs, capsys):
  """Each variant's mean steps × dense's mean at that P; "never" with the seeds' steps."""
  assert scale.main(["--runs", str(runs), "--target", "0.98", "--title", "case"]) == 0
  out = capsys.readouterr().out
  assert "| 8 | 30 (1.00×) | 30 (1.00×) | 20 (0.67×) | never (never, never) |  |" in out
  assert "| 16 | 30 (1.00×) | 40 (1.33×) |  |" in out  # no 5 % run at P = 16
  assert "| 8 | 0.965, 0 B | 0.960, 0 B | 0.960, 0 B | 0.700, 0 B |  |" in out
  with pytest.raises(SystemExit):
    scale.main(["--runs", str(runs), "--projection", str(runs)])
  assert "--projection needs --model" in capsys.readouterr().err


def test_several_targets_add_each_variants_steps_to_each(runs, capsys):
  """--target 0.98,0.5 without a projection: a table per target, then one line per (P,
  variant) with its steps to each (per seed) over dense's at that P, its finals and bytes;
  with a projection one target only."""
  assert scale.main(["--runs", str(runs), "--target", "0.98,0.5"]) == 0
  out = capsys.readouterr().out
  assert out.count("# Steps to ") == 2
  # 0.5 of 0.965 is 0.4825: dense reaches it at step 10, SparDL 1 % at 20 (0.4 < 0.4825).
  assert ("| P = 8 | spardl | 30 (30, 30) | 1.00 | 20 (20, 20) | 2.00 | 0.960 (0.960, 0.960) "
          "| 0 | – |") in out
  assert "| P = 8 | topka | never (never, never) | – | 20 (20, 20) | 2.00 |" in out
  assert "| P = 16 | gtopk | 20 (20) | 0.67 | 10 (10) | 1.00 | 0.960 (0.960) |" in out
  with pytest.raises(SystemExit):
    scale.main(["--runs", str(runs), "--projection", str(runs), "--model", "mlp",
                "--target", "0.95,0.98"])
  assert "--target: one fraction with --projection" in capsys.readouterr().err


def test_the_density_rule_is_projected_at_its_density_for_p(tmp_path):
  """``spardl:density=auto`` at P = 16 sends at the rule's 2.5 % * log2 16 / log2 8 = 3.33 %,
  and the best-density table names it by the rule."""
  write_run(tmp_path / "s0_p16", 16, 0, [
      ("dense", "dense", {}, [0.5, 0.9, 0.95, 0.96]),
      ("spardl", "spardl", {"density": 0.01, "wire": "exact"}, [0.4, 0.8, 0.9, 0.95]),
      ("spardl:density=auto", "spardl", {"density": "auto", "wire": "exact"},
       [0.5, 0.95, 0.96, 0.96])])
  steps = scale.steps_table(scale.load_runs([str(tmp_path)]), 0.98)
  times = scale.time_rows(steps, PROJECTION, SHAPES)
  (auto,) = [r for r in times if r["key"] == "spardl:density=auto"]
  assert auto["seconds"] == pytest.approx(20 * spardl(16, 0.025 * 4 / 3), rel=1e-9)
  firsts = scale.first_rows(times)
  assert firsts[0]["best"]["spardl"] == (pytest.approx(auto["seconds"]), "auto")
  text = scale.report(steps, times, firsts, fraction=0.98, title="case")
  assert f"| 10gbe | 16 | {30 * dense(16):.2f} | {auto['seconds']:.2f} @auto |" in text


def test_bad_flags(runs, tmp_path, capsys):
  with pytest.raises(SystemExit):
    scale.main(["--runs", str(tmp_path / "none"), "--projection", str(tmp_path),
                "--model", "mlp"])
  assert "--projection: no projection.json" in capsys.readouterr().err
  (tmp_path / "projection.json").write_text(json.dumps(PROJECTION))
  with pytest.raises(SystemExit):
    scale.main(["--runs", str(tmp_path / "none"), "--projection", str(tmp_path),
                "--model", "mlp"])
  assert "--runs: no metrics.json" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    scale.main(["--runs", str(runs), "--projection", str(tmp_path), "--model", "mlp",
                "--target", "1.5"])
  assert ("argument --target: must be a comma list of fractions in (0, 1], got '1.5'"
          in capsys.readouterr().err)


def test_variants_keeps_those_labels_in_their_order_and_names_an_unknown_one():
  rows = [RowAtP(f"P = {p}", label, label, "accuracy", [], [], 0.0, p=p)
          for p in (8, 16) for label in ("a", "dense", "b")]
  assert [(r.p, r.key) for r in scale.only(rows, ["b", "dense"])] == [
      (8, "b"), (8, "dense"), (16, "b"), (16, "dense")]
  assert scale.only(rows, None) is rows
  with pytest.raises(ValueError, match=r"--variants: no runs of 'c'; the runs have a, dense, b"):
    scale.only(rows, ["dense", "c"])


def test_an_experiments_runs_folded_into_one_file_read_as_before(runs, tmp_path):
  """benchmarks.runs --bundle: every metrics.json (and log) under a folder into its
  runs.json, the files and the folders they leave empty gone; the drivers read the same
  runs in the same order, from the folder or from one of its run folders, and a second
  bundle of one run's folder is refused."""
  (runs / "s0_p8.log").write_text("the job's output\n")
  before = scale.steps_table(scale.load_runs([str(runs)]), 0.98)
  one_p = scale.load_runs([str(runs / "s0_p16")])
  assert lab_runs.main(["--bundle", str(runs)]) == 0
  assert sorted(p.name for p in runs.iterdir()) == [lab_runs.BUNDLE]
  held = json.loads((runs / lab_runs.BUNDLE).read_text())
  assert sorted(held["runs"]) == ["s0_p16", "s0_p16_more", "s0_p8", "s1_p8"]
  assert held["logs"] == {"s0_p8.log": "the job's output\n"}
  assert scale.steps_table(scale.load_runs([str(runs)]), 0.98) == before
  assert scale.load_runs([str(runs / "s0_p16")]) == one_p  # a folder the bundle holds
  assert lab_runs.lookup(str(runs / "s0_p8" / "metrics.json")) == lab_runs.read(
      str(runs / "s0_p8" / "metrics.json")) != []
  assert lab_runs.lookup(str(runs / "s9_p8" / "metrics.json")) is None
  write_run(runs / "s0_p8", 8, 0, [("dense", "dense", {}, [0.5])])
  with pytest.raises(ValueError, match="holds 's0_p8' already"):
    lab_runs.bundle(str(runs))


def test_the_bundler_checks_everything_first_refuses_a_live_run_and_can_run_again(runs):
  """Bad files are all named and nothing is written or removed; a run a live trainer holds is
  refused; a fold interrupted after the bundle was written (its files still on disk)
  finishes on the next call, the same run found twice being one run."""
  import subprocess
  import sys
  before = sorted(str(p.relative_to(runs)) for p in runs.rglob("*"))
  (runs / "empty").mkdir()
  (runs / "empty" / "metrics.json").write_text("{}")
  (runs / "none").mkdir()
  (runs / "none" / "metrics.json").write_text('{"config": {}, "runs": []}')
  (runs / "cut").mkdir()
  (runs / "cut" / "metrics.json").write_text('{"config": {"devices": 8, "ru')
  (runs / "job.log").write_bytes(b"\xff\xfe not utf-8")
  with pytest.raises(ValueError, match=r"nothing written or removed") as refused:
    lab_runs.bundle(str(runs))
  for name in ("empty", "none", "cut", "job.log"):
    assert str(runs / name) in str(refused.value), name
  for name in ("empty", "none", "cut"):
    shutil.rmtree(runs / name)
  (runs / "job.log").unlink()
  assert sorted(str(p.relative_to(runs)) for p in runs.rglob("*")) == before
  # A trainer holding its run's lock: refused, nothing touched.
  holder = subprocess.Popen(
      [sys.executable, "-c", "import sys, time; sys.path.insert(0, '.'); from train import "
       f"lock\nwith lock.writer({str(runs / 's0_p8')!r}):\n  print('held', flush=True); "
       "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(ValueError, match=r"s0_p8 is a run being written"):
      lab_runs.bundle(str(runs))
    assert not (runs / lab_runs.BUNDLE).exists()
  finally:
    holder.kill()
    holder.wait()
  # Interrupted after the bundle was written: the runs still on disk are the bundle's.
  kept = {p: p.read_bytes() for p in runs.rglob("metrics.json")}
  assert lab_runs.bundle(str(runs)) == 4
  for path, content in kept.items():
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(content)
  assert lab_runs.bundle(str(runs)) == 4
  assert sorted(p.name for p in runs.iterdir()) == [lab_runs.BUNDLE]
