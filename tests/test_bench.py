"""Smoke test of the benchmark (tiny sizes; it asserts what is measured, never wall time)."""

import argparse

from spardl_jax import bench


def test_bench_rows_report_hlo_traffic_equal_to_formula():
  args = argparse.Namespace(devices=3, n=[1000, 2001], density=0.05, repeats=1, seed=0,
                            out=None, trace=None)
  rows = bench.run(args)
  assert [r["n"] for r in rows] == [1000, 2001]
  for r in rows:
    assert r["hlo_bytes_per_device"] == r["formula_bytes"]
    assert r["hlo_rounds"] == r["formula_rounds"] == 4
    assert r["other_collectives"] == []
    assert r["dense_s"] > 0 and r["spardl_s"] > 0
  assert "| 2,001 | 3 |" in bench.format_table(rows)
