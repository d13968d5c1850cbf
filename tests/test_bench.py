"""Smoke test of the benchmark (tiny sizes; it asserts what is measured, never wall time)."""

from spardl_jax import bench


def test_bench_rows_report_hlo_traffic_equal_to_formula():
  args = bench._parse_args(["--devices", "3", "--n", "1000,2001", "--density", "0.05",
                            "--repeats", "1"])
  rows = bench.run(args)
  assert [r["n"] for r in rows] == [1000, 2001]
  for r in rows:
    assert r["hlo_bytes_per_device"] == r["formula_bytes"]
    assert r["hlo_rounds"] == r["formula_rounds"] == 4
    assert r["other_collectives"] == []
    assert r["dense_s"] > 0 and r["spardl_s"] > 0
  assert "| 2,001 | 3 | 1 |" in bench.format_table(rows)


def test_bench_sweeps_every_team_count_and_marks_the_model_pick():
  args = bench._parse_args(["--devices", "6", "--n", "3000", "--teams", "all", "--repeats",
                            "1"])
  rows = bench.run(args)
  assert [(r["teams"], r["sag"]) for r in rows] == [(1, "-"), (2, "recursive"), (3, "bruck"),
                                                    (6, "bruck")]
  for r in rows:
    assert r["hlo_bytes_per_device"] == r["formula_bytes"]
    assert r["hlo_rounds"] == r["formula_rounds"]
  assert sum(r["model_pick"] for r in rows) == 1
  picked = min(rows, key=lambda r: (r["modeled_s"], r["teams"]))
  assert picked["model_pick"]
