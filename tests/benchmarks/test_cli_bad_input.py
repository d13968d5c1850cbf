"""Bad input to the command lines other than the trainer's (tests/trainer/test_train.py has
its table): one row per mistake, each exits 2 with one line naming the flag, and nothing runs
or is written (docs/reliability.md lists every row)."""

import json

import pytest

from spardl_jax import launch
from spardl_jax.tools import bench
from benchmarks import convergence, runs, time_to_accuracy


def fake_tta_run(out, devices=2, methods=("dense",)):
  """A finished time-to-accuracy run of ``devices`` processes that trained ``methods``."""
  run = out / "seed0" / "unshaped"
  run.mkdir(parents=True)
  history = [{"steps": 2, "test_accuracy": 0.5, "train_seconds": 1.0, "bytes_sent": 8.0}]
  (run / "metrics.json").write_text(json.dumps({
      "config": {"devices": devices, "seed": 0,
                 "variants": [{"label": m, "method": m, "options": {}} for m in methods]},
      "runs": [{"method": m, "metric": "accuracy", "num_params": 10, "bytes_per_step": 4.0,
                "time_per_step": 0.5, "history": history} for m in methods]}))
  (out / "results.json").write_text(json.dumps({"args": {}, "rows": [{"rate": "unshaped"}]}))
  return out


def fake_convergence_run(out, keys=("dense",), bytes_per_step=4.0):
  """A convergence run's results.json (as --no-dense writes it) with ``keys``' runs."""
  out.mkdir(parents=True)
  rows = [{"case": "mnist1d_cnn1d", "key": k, "variant": k, "metric": "accuracy",
           "bytes_per_step": bytes_per_step, "curves": [[[10, 40.0, 0.5, 1.0]]]}
          for k in keys]
  (out / "results.json").write_text(json.dumps({"rows": rows}))
  return out


TTA = ["--local", "--rates", "unshaped", "--model-size", "tiny"]
ROWS = [
    ("tta --timeout -1", time_to_accuracy.main, lambda tmp: TTA + ["--timeout", "-1"],
     "argument --timeout: must be > 0.0 and finite, got -1"),
    ("tta --timeout nan", time_to_accuracy.main, lambda tmp: TTA + ["--timeout", "nan"],
     "argument --timeout: must be > 0.0 and finite, got nan"),
    ("tta --alpha -1", time_to_accuracy.main, lambda tmp: TTA + ["--alpha", "-1"],
     "argument --alpha: must be >= 0.0 and finite, got -1"),
    ("tta --processes 0", time_to_accuracy.main, lambda tmp: TTA + ["--processes", "0"],
     "argument --processes: must be >= 1, got 0"),
    ("tta --out at a file", time_to_accuracy.main,
     lambda tmp: TTA + ["--out", str(tmp / "file")], "is a file, not a directory"),
    ("tta --report, a method with no runs", time_to_accuracy.main,
     lambda tmp: ["--report", "--processes", "2", "--methods", "dense,spardl", "--rates",
                  "unshaped", "--out", str(fake_tta_run(tmp / "tta"))],
     "has no run of ['spardl']: it holds ['dense']"),
    ("tta --report --processes 5 over a 2-process run", time_to_accuracy.main,
     lambda tmp: ["--report", "--processes", "5", "--methods", "dense", "--rates", "unshaped",
                  "--out", str(fake_tta_run(tmp / "tta"))],
     "was trained on 2 processes: pass --processes 2, got 5."),
    *[(f"convergence --devices {d}", convergence.main,
       lambda tmp, d=d: ["--devices", d, "--out", str(tmp / "cv")],
       f"argument --devices: must be >= 1, got {d}") for d in ("0", "-2")],
    ("convergence --devices 3", convergence.main,
     lambda tmp: ["--devices", "3", "--cases", "mnist1d_cnn1d", "--out", str(tmp / "cv")],
     "--devices 3 does not divide the batch size of mnist1d_cnn1d (128)"),
    ("convergence --target 1.5", convergence.main,
     lambda tmp: ["--target", "1.5", "--out", str(tmp / "cv")],
     "argument --target: must be a comma list of fractions in (0, 1], got '1.5'"),
    ("convergence --target 0.95,0", convergence.main,
     lambda tmp: ["--target", "0.95,0", "--out", str(tmp / "cv")],
     "argument --target: must be a comma list of fractions in (0, 1], got '0.95,0'"),
    ("convergence --seeds 0,x", convergence.main,
     lambda tmp: ["--seeds", "0,x", "--out", str(tmp / "cv")],
     "argument --seeds: must be a comma list of integer seeds, got '0,x'"),
    ("convergence --outer-momentum 1", convergence.main,
     lambda tmp: ["--variants", "outer", "--outer-momentum", "1", "--out", str(tmp / "cv")],
     "--outer-momentum must be in [0, 1), got 1.0"),
    ("convergence, a variant that cannot run on its case's mesh", convergence.main,
     lambda tmp: ["--cases", "shakespeare_gpt_sharded", "--variants", "powersgd", "--seeds",
                  "0", "--out", str(tmp / "cv")],
     "--cases shakespeare_gpt_sharded --variants powersgd: sync_gradients: 'powersgd' "
     "compresses each parameter as a matrix"),
    ("convergence --variants, a group then an unknown name", convergence.main,
     lambda tmp: ["--variants", "adam,nosuch", "--out", str(tmp / "cv")],
     "--variants: unknown 'nosuch'"),
    ("convergence --no-dense without variants", convergence.main,
     lambda tmp: ["--no-dense", "--variants", "dense", "--out", str(tmp / "cv")],
     "--no-dense: name the variants to run with --variants"),
    ("convergence --report without dense's runs", convergence.main,
     lambda tmp: ["--report", str(fake_convergence_run(tmp / "cv0", keys=("recipe",))),
                  "--out", str(tmp / "cv")],
     "--report: no dense runs of mnist1d_cnn1d in"),
    ("convergence --report, one variant sending different bytes in two directories",
     convergence.main,
     lambda tmp: ["--report", f"{fake_convergence_run(tmp / 'a', keys=('dense', 'v'))},"
                  f"{fake_convergence_run(tmp / 'b', keys=('v',), bytes_per_step=8.0)}",
                  "--out", str(tmp / "cv")],
     "mnist1d_cnn1d 'v' sending 8.0 bytes a step, another directory 4.0: not the same"),
    ("convergence --report, one variant twice with no seeds recorded", convergence.main,
     lambda tmp: ["--report", f"{fake_convergence_run(tmp / 'a', keys=('dense', 'v'))},"
                  f"{fake_convergence_run(tmp / 'b', keys=('v',))}", "--out", str(tmp / "cv")],
     "and the seeds of one of them are not recorded"),
    ("convergence --report at a missing directory", convergence.main,
     lambda tmp: ["--report", str(tmp / "missing"), "--out", str(tmp / "cv")],
     "results.json (a directory python -m benchmarks.convergence wrote with --out)"),
    ("convergence --report at a time-to-accuracy run", convergence.main,
     lambda tmp: ["--report", str(fake_tta_run(tmp / "tta")), "--out", str(tmp / "cv")],
     "does not hold convergence results"),
    ("convergence --goals with two numbers", convergence.main,
     lambda tmp: ["--goals", "1.25,0.02", "--out", str(tmp / "cv")],
     "argument --goals: must be STEPS,FINAL,BYTES, three positive numbers"),
    ("convergence --goals with a negative number", convergence.main,
     lambda tmp: ["--goals", "1.25,-0.02,15", "--out", str(tmp / "cv")],
     "argument --goals: must be STEPS,FINAL,BYTES, three positive numbers"),
    ("convergence --judge without --goals", convergence.main,
     lambda tmp: ["--judge", "recipe", "--out", str(tmp / "cv")],
     "--judge names the variants --goals judges: give --goals STEPS,FINAL,BYTES too"),
    ("convergence --judge a variant not run", convergence.main,
     lambda tmp: ["--variants", "recipe", "--goals", "1,1,1", "--judge", "paper", "--out",
                  str(tmp / "cv")],
     "--judge: paper not among the variants run (dense, recipe)"),
    ("convergence --report --judge a variant not reported", convergence.main,
     lambda tmp: ["--report", str(fake_convergence_run(tmp / "cv0", keys=("dense", "v"))),
                  "--goals", "1,1,1", "--judge", "w", "--out", str(tmp / "cv")],
     "--judge: w not in"),
    ("runs --bundle at no folder", runs.main, lambda tmp: ["--bundle", str(tmp / "nowhere")],
     "--bundle: not a folder:"),
    ("tta --local at a shaped rate", time_to_accuracy.main,
     lambda tmp: ["--local", "--rates", "100mbit"],
     "--local cannot shape the network: use --rates unshaped, got ['100mbit']"),
    ("tta --methods without dense", time_to_accuracy.main,
     lambda tmp: ["--methods", "spardl"], "--methods must include 'dense' (it sets the target)"),
    ("tta --dense-from with dense in --methods", time_to_accuracy.main,
     lambda tmp: TTA + ["--methods", "dense,spardl", "--dense-from", str(tmp)],
     "--dense-from reads dense's runs: leave 'dense' out of --methods"),
    ("tta --dense-from at no directory", time_to_accuracy.main,
     lambda tmp: TTA + ["--methods", "spardl", "--dense-from", str(tmp / "nowhere")],
     "is not a directory"),
    ("tta --methods with an unknown method", time_to_accuracy.main,
     lambda tmp: TTA + ["--methods", "dense,nosuch", "--out", str(tmp / "cv")],
     "method spec 'nosuch': the method must be one of"),
    ("tta --methods with a bad option", time_to_accuracy.main,
     lambda tmp: TTA + ["--methods", "dense,spardl:density=2", "--out", str(tmp / "cv")],
     "--methods 'spardl:density=2': SparDLConfig: density must be in (0, 1]"),
    ("tta --targets 0.9,1.5", time_to_accuracy.main, lambda tmp: ["--targets", "0.9,1.5"],
     "argument --targets: must be a comma list of fractions in (0, 1], got '0.9,1.5'"),
    ("tta --seeds 0,x", time_to_accuracy.main, lambda tmp: ["--seeds", "0,x"],
     "argument --seeds: must be a comma list of integer seeds, got '0,x'"),
    ("launch --processes 0", launch.main, lambda tmp: ["--processes", "0", "--", "true"],
     "--processes and --devices-per-process must be >= 1"),
    ("launch --timeout nan", launch.main,
     lambda tmp: ["--processes", "1", "--timeout", "nan", "--", "true"],
     "--timeout must be a positive, finite number of seconds"),
    ("bench --density 0", bench.main, lambda tmp: ["--density", "0"],
     "--density must be in (0, 1], got 0.0"),
    ("bench --density nan", bench.main, lambda tmp: ["--density", "nan"],
     "--density must be in (0, 1], got nan"),
    ("bench --beta 0", bench.main, lambda tmp: ["--beta", "0"],
     "--beta must be a positive, finite number"),
    ("bench --densities 0.01,2", bench.main, lambda tmp: ["--selection", "--densities", "0.01,2"],
     "--densities must be a comma list of numbers in (0, 1], got '0.01,2'"),
    ("bench --pieces --density 0.9", bench.main, lambda tmp: ["--pieces", "--density", "0.9"],
     "--pieces: --density must be at most 0.5, got 0.9"),
    ("bench --methods nosuch", bench.main, lambda tmp: ["--methods", "nosuch"],
     "--methods: unknown ['nosuch']"),
]


@pytest.mark.parametrize("main,argv,message", [row[1:] for row in ROWS],
                         ids=[row[0] for row in ROWS])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, main, argv, message):
  (tmp_path / "file").write_text("")
  try:
    code = main(argv(tmp_path))
  except SystemExit as exit_:  # argparse's own checks
    code = exit_.code
  assert code == 2
  captured = capsys.readouterr()
  err = [line for line in captured.err.strip().splitlines() if not line.startswith("usage:")
         and not line.startswith("  ") and not line.startswith("no run for")]
  assert len(err) == 1 and message in err[0], captured.err
  assert not (tmp_path / "cv").exists()  # nothing trained, nothing written
