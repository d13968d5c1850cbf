"""Smoke tests of the benchmark (tiny sizes; they assert what is measured, never wall time)."""

import json

from spardl_jax.tools import bench
from spardl_jax.tools.bench import pieces
from tests import formulas


def test_bench_rows_report_hlo_traffic_equal_to_formula():
  args = bench._parse_args(["--devices", "3", "--n", "2001", "--density", "0.05",
                            "--repeats", "1", "--methods", "spardl"])  # both wire formats
  rows = bench.run(args)
  assert [(r["n"], r["method"]) for r in rows] == [(2001, "spardl"), (2001, "spardl compact")]
  for r in rows:
    wire = "compact" if "compact" in r["method"] else "exact"
    assert r["hlo_bytes_per_device"] == formulas.spardl(3, r["n"], 0.05, wire=wire)["bytes"]
    assert r["hlo_bytes_per_device"] == r["formula_bytes"]
    assert r["hlo_rounds"] == r["formula_rounds"] == 4
    assert r["other_collectives"] == []
    assert r["time_s"] > 0
  assert "| 2,001 | 3 | spardl |" in bench.format_table(rows)


def test_bench_sweeps_every_team_count_and_marks_the_model_pick():
  # A small n keeps B-SAG's ladder short (d = 6: h in 1..6), so the compiles are quick.
  args = bench._parse_args(["--devices", "6", "--n", "600", "--teams", "all", "--repeats",
                            "1", "--methods", "spardl", "--max-memory-gb", "0",  # untimed
                            "--wire", "exact"])
  rows = bench.run(args)
  assert [r["method"] for r in rows] == ["spardl", "spardl d=2 (R-SAG)", "spardl d=3 (B-SAG)",
                                         "spardl d=6 (B-SAG)"]
  for r in rows:
    assert r["hlo_bytes_per_device"] == r["formula_bytes"]
    assert r["hlo_rounds"] == r["formula_rounds"]
  assert sum(r["model_pick"] for r in rows) == 1
  picked = min(rows, key=lambda r: (r["modeled_s"], r["teams"]))
  assert picked["model_pick"]


def test_bench_all_methods_side_by_side(tmp_path):
  args = bench._parse_args(["--devices", "4", "--n", "4000", "--repeats", "1", "--out",
                            str(tmp_path), "--max-memory-gb", "0", "--wire", "exact"])  # HLO only
  rows = bench.run(args)
  assert [r["method"] for r in rows] == list(bench.flat_methods())
  by_name = {r["method"]: r for r in rows}
  # Dense: the all-reduce's measured operand (n float32) through a ring, 2 (P - 1) / P of it;
  # dense_bf16: its own ring of bfloat16 permutes, half the bytes.
  assert by_name["dense"]["hlo_bytes_per_device"] == 2 * 3 * 4000 * 4 // 4
  assert by_name["dense_bf16"]["hlo_bytes_per_device"] == formulas.dense_bf16(4, 4000)
  assert formulas.dense_bf16(4, 4000) == 2 * 3 * 4000 * 2 // 4
  assert by_name["spardl"]["hlo_bytes_per_device"] == formulas.spardl(4, 4000, 0.01)["bytes"]
  assert by_name["topka"]["hlo_bytes_per_device"] == formulas.topka(4, 4000, 0.01)["bytes"]
  for r in rows:
    assert r["hlo_bytes_per_device"] == r["formula_bytes"], r["method"]
    assert r["hlo_rounds"] == r["formula_rounds"], r["method"]
  spardl = next(r for r in rows if r["method"] == "spardl")
  assert spardl["paper_latency_rounds"] == spardl["hlo_rounds"]
  assert spardl["paper_bandwidth_elements"][0] == spardl["hlo_elements"]
  assert "topkdsa" in bench.format_table1(rows)
  bench.plot(rows, str(tmp_path / "modeled_time.png"))
  assert (tmp_path / "modeled_time.png").stat().st_size > 0


def test_selection_benchmark_is_exact_and_complete():
  """--selection: every candidate timed, each of SparDL's selections equal to lax.top_k's
  set."""
  args = bench._parse_args(["--selection", "--n", "3000", "--densities", "0.01,0.5",
                            "--repeats", "1"])
  rows = bench.run_selection(args)
  assert [(r["n"], r["k"]) for r in rows] == [(3000, 30), (3000, 1500)]
  for r in rows:
    assert r["exact"]
    assert r["default"] in ("count", "radix", "sort", "sort_one_stage")
    assert all(r[f"{name}_s"] > 0 for name in ("count", "radix", "sort", "sort_one_stage",
                                               "top_k", "approx_max_k", "dense_pass"))
  assert "| 3,000 | 0.01 | 30 |" in bench.format_selection(rows)


def test_emulated_sync_on_one_device():
  """--emulate: each method's whole sync with P ranks batched by jax.vmap on one device;
  every rank gets the same result; gTopk's partial permutations cannot be batched, and the
  row says so instead of a time."""
  args = bench._parse_args(["--emulate", "--devices", "4", "--n", "2000", "--repeats", "1",
                            "--methods", "spardl,dense,gtopk", "--wire", "exact"])
  rows = bench.run_emulated(args)
  assert [r["method"] for r in rows] == ["spardl", "dense", "gtopk"]
  for r in rows[:2]:
    assert r["identical_ranks"] and r["time_s"] > 0 and r["per_rank_s"] == r["time_s"] / 4
  assert rows[2]["time_s"] is None and "not emulable with jax.vmap" in rows[2]["skipped"]
  assert "| 2,000 | 4 | dense |" in bench.format_emulated(rows)


def test_out_keeps_the_rows_where_they_were_measured_and_their_tables(tmp_path, capsys):
  """--out: the rows with the arguments, the commit, the machine, the versions and the
  selection method (selection.json), and the tables printed, as the rows render them
  (selection.md)."""
  assert bench.main(["--selection", "--n", "3000", "--densities", "0.01", "--repeats", "1",
                     "--out", str(tmp_path)]) == 0
  saved = json.loads((tmp_path / "selection.json").read_text())
  assert {"args", "commit", "date", "machine", "versions", "selection", "rows"} <= set(saved)
  assert saved["args"]["n"] == [3000] and saved["versions"]["jax"]
  tables = bench.report("selection", saved["rows"])
  assert tables in (tmp_path / "selection.md").read_text()
  assert tables in capsys.readouterr().out


def test_pieces_times_every_piece_and_keeps_its_rows(tmp_path, capsys):
  """--pieces: every piece of the competitors (and the operations under them) timed at
  k = density · n, the rows kept with where they were measured (pieces.json) and their
  table beside them as the rows render it (pieces.md)."""
  assert bench.main(["--pieces", "--n", "4000", "--repeats", "1", "--out", str(tmp_path)]) == 0
  saved = json.loads((tmp_path / "pieces.json").read_text())
  assert [r["piece"] for r in saved["rows"]] == list(pieces.WHAT)
  assert all(r["k"] == 40 and len(r["times_ms"]) == 1 for r in saved["rows"])
  assert bench.kind_of(saved["args"]) == "pieces" and saved["commit"]
  table = bench.report("pieces", saved["rows"])
  assert "| piece (n = 4,000, k = 40) | what | ms (median of 1) |" in table
  assert table in (tmp_path / "pieces.md").read_text() and table in capsys.readouterr().out
