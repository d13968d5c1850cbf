"""The published pages against their raw outputs: every table the scale page copies from a
report is that report's, and every report re-renders from the raw file beside it (the
projection's rows, the time-to-accuracy runs' steps and times, the paper comparison's
formulas). A page typed by hand, or a report edited after it was written, fails here."""

import contextlib
import dataclasses
import functools
import glob
import io
import json
import os
import pathlib
import re
import subprocess
import tempfile

import pytest

from benchmarks import paper_compare, project, runs, scale

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
TTA = sorted(glob.glob(os.path.join(RESULTS, "scale", "tta", "*", "results.json")))
PROJECTIONS = sorted(glob.glob(os.path.join(RESULTS, "scale", "*", "projection.json")))


def _read(path):
  with open(path) as f:
    return f.read()


@pytest.mark.parametrize("path", TTA, ids=lambda p: p.split(os.sep)[-2])
def test_a_time_to_accuracy_report_re_renders_from_its_raw_file(path):
  raw = json.loads(_read(path))
  text = scale.report([runs.RowAtP.from_json(r) for r in raw["steps"]], raw["times"],
                      raw["first"], fraction=raw["args"]["target"], title=raw["title"])
  sensitivity = {float(k): v for k, v in raw.get("first_at_alpha", {}).items()}
  if sensitivity:
    text += scale.alpha_table(raw["first"], sensitivity)
  assert text == _read(os.path.join(os.path.dirname(path), "results.md"))


@pytest.mark.parametrize("path", sorted(
    os.path.dirname(p) for p in glob.glob(os.path.join(RESULTS, "**", "metrics.json"),
                                          recursive=True)
    if os.path.exists(os.path.join(os.path.dirname(p), "results.md"))),
    ids=lambda p: os.path.relpath(p, RESULTS))
def test_a_trainer_runs_table_re_renders_from_its_metrics(path):
  """The Markdown summary ``python -m train`` writes beside its ``metrics.json`` (which a
  page may copy) is that file's runs."""
  from train import report
  runs = json.loads(_read(os.path.join(path, "metrics.json")))["runs"]
  assert report.format_markdown(runs) == _read(os.path.join(path, "results.md"))


@pytest.mark.parametrize("path", PROJECTIONS, ids=lambda p: p.split(os.sep)[-2])
def test_a_projection_table_re_renders_from_its_rows(path):
  raw = json.loads(_read(path))
  title = raw["args"]["title"] or f"n = {raw['args']['n']:,}"
  assert project.fastest_table(raw["rows"], title) == _read(
      os.path.join(os.path.dirname(path), "fastest.md"))


def test_the_paper_comparison_re_renders():
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    paper_compare.main([])
  assert out.getvalue() == _read(os.path.join(RESULTS, "scale", "paper_compare.md"))


def _tables(text):
  """Every Markdown table of ``text``: runs of lines that start with ``|``."""
  return [block.strip() for block in re.findall(r"(?:^\|.*(?:\n|\Z))+", text, re.M)]


def test_every_table_the_scale_page_copies_is_its_reports():
  """A table of scale.md whose header is a report's header is one of that report's tables,
  line for line."""
  rendered = [t for path in (glob.glob(os.path.join(RESULTS, "scale", "tta", "*", "results.md"))
                             + glob.glob(os.path.join(RESULTS, "scale", "*", "fastest.md"))
                             + [os.path.join(RESULTS, "scale", "paper_compare.md")])
              for t in _tables(_read(path))]
  headers = {t.splitlines()[0] for t in rendered}
  copied = [t for t in _tables(_read(os.path.join(RESULTS, "scale.md")))
            if t.splitlines()[0] in headers]
  assert len(copied) >= 7  # the projection, time to accuracy and paper sections
  for table in copied:
    assert table in rendered, table.splitlines()[:3]


OVERLAP = sorted(glob.glob(os.path.join(RESULTS, "network", "overlap", "*", "results.json")))


@pytest.mark.parametrize("path", OVERLAP, ids=lambda p: p.split(os.sep)[-2])
def test_an_overlap_report_re_renders_from_its_raw_file(path):
  import argparse

  from benchmarks import overlap
  raw = json.loads(_read(path))
  assert overlap.table(raw["seconds"], argparse.Namespace(**raw["args"])) + "\n" == _read(
      os.path.join(os.path.dirname(path), "results.md"))


def test_every_table_the_network_page_copies_from_the_delay_runs_is_theirs():
  """network.md's "Hiding the sync" copies the overlap probes' and the delayed runs' time to
  accuracy tables: each is one of those reports' tables, line for line."""
  reports = (glob.glob(os.path.join(RESULTS, "network", "overlap", "*", "results.md"))
             + glob.glob(os.path.join(RESULTS, "network", "delay", "*", "results.md"))
             + glob.glob(os.path.join(RESULTS, "scale", "steps", "delay", "steps_*.md")))
  rendered = [t for path in reports for t in _tables(_read(path))]
  page = _read(os.path.join(RESULTS, "network.md"))
  section = page[page.index("## Hiding the sync"):]
  copied = _tables(section[:section.find("\n## ", 1) if "\n## " in section[1:] else None])
  assert len(copied) >= 3
  for table in copied:
    assert table in rendered, table.splitlines()[:3]


@pytest.mark.parametrize("target", ["0.95", "0.98"])
def test_the_delayed_runs_steps_re_render(target, monkeypatch):
  """The main job's steps with and without the delay (network.md copies them); the report
  names the runs' folder as the command gave it, from the repository."""
  monkeypatch.chdir(ROOT)
  runs = os.path.join("benchmarks", "results", "scale", "steps", "delay")
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    scale.main(["--runs", runs, "--target", target])
  assert out.getvalue() == _read(os.path.join(runs, f"steps_{target[2:]}.md"))


def _raw_with_table(holds) -> list[str]:
  """Every ``*.json`` under benchmarks/results with its table beside it (the same name,
  ``.md``) whose content ``holds`` accepts (``holds(raw)``, ``raw`` a dict)."""
  return sorted(path for path in glob.glob(os.path.join(RESULTS, "**", "*.json"), recursive=True)
                if os.path.isfile(path[:-len(".json")] + ".md")
                and isinstance(raw := json.loads(_read(path)), dict) and holds(raw))


@pytest.mark.parametrize("path", _raw_with_table(lambda raw: "over_seeds" in raw),
                         ids=lambda p: os.path.relpath(p, RESULTS).replace(os.sep, "/"))
def test_a_paced_time_to_accuracy_report_re_renders_from_its_raw_file(path):
  """``benchmarks.time_to_accuracy``'s report (the side-by-side table a page copies
  included) from the rows it keeps, each seed's run at each rate."""
  from benchmarks import time_to_accuracy
  raw = json.loads(_read(path))
  rows = [time_to_accuracy.Timed.from_json(r) for r in raw["rows"]]
  summary = time_to_accuracy.over_seeds(rows)
  assert [dataclasses.asdict(o) for o in summary] == raw["over_seeds"]
  text = time_to_accuracy.format_table(rows, summary, type("Args", (), raw["args"]))
  assert text + "\n" == _read(path[:-5] + ".md")


@pytest.mark.parametrize("path", _raw_with_table(lambda raw: "against" in raw.get("args", {})),
                         ids=lambda p: os.path.relpath(p, RESULTS).replace(os.sep, "/"))
def test_a_versus_report_re_renders_from_its_medians(path):
  from benchmarks import versus
  raw = json.loads(_read(path))
  assert versus.report([tuple(r) for r in raw["rows"]], raw["args"]) + "\n" == _read(
      path[:-5] + ".md")


def _bench_raw():
  """Every raw output of ``spardl-bench --out`` that has its tables beside it (``KIND.json``
  and ``KIND.md``; the H200's files are named by their run)."""
  return _raw_with_table(lambda raw: "max_memory_gb" in raw.get("args", {}))


@pytest.mark.parametrize("path", _bench_raw(),
                         ids=lambda p: os.path.relpath(p, RESULTS).replace(os.sep, "/"))
def test_a_bench_report_re_renders_from_its_rows(path):
  """The tables ``spardl-bench`` wrote beside its rows are the ones the rows render now."""
  from spardl_jax.tools import bench
  raw = json.loads(_read(path))
  assert bench.report(bench.kind_of(raw["args"]), raw["rows"]) in _read(path[:-5] + ".md")


def _profile_raw():
  """Every ``benchmarks.sync_profile --out`` file with the report it printed beside it."""
  return _raw_with_table(lambda raw: "total_us" in raw and "stage" in raw["rows"][0])


@pytest.mark.parametrize("path", _profile_raw(),
                         ids=lambda p: os.path.relpath(p, RESULTS).replace(os.sep, "/"))
def test_a_profile_report_re_renders_from_its_rows(path):
  from benchmarks import sync_profile
  raw = json.loads(_read(path))
  args = raw["args"]
  assert sync_profile.report(
      args["method"], p=args["ranks"], n=args["n"], simulated=args["simulated"],
      rows=[(r["stage"], r["module"], r["us"]) for r in raw["rows"]],
      total=raw["total_us"]) in _read(path[:-5] + ".md")


def test_the_selection_pages_stage_comparison_re_renders():
  from benchmarks import sync_profile
  raw = os.path.join(RESULTS, "selection")
  profiles = {label: json.loads(_read(os.path.join(raw, f"profile_cpu_{name}.json")))
              for label, name in (("before", "d02de91"), ("now", "now"))}
  assert sync_profile.compare(profiles) + "\n" == _read(
      os.path.join(raw, "profile_cpu_compare.md"))


def _selection_gpu_tables():
  """The H200 section's tables as their JSON files render them (selection, per rank, the
  stages' two), and the per-rank rows."""
  from benchmarks import per_rank, sync_profile
  from spardl_jax.tools import bench
  raw = os.path.join(RESULTS, "selection", "h200")
  ranks = [row for size in ("14.7e6", "66e6")
           for row in json.loads(_read(os.path.join(raw, f"per_rank_{size}.json")))["rows"]]
  profile = json.loads(_read(os.path.join(raw, "profile.json")))
  args = profile["args"]
  stages = sync_profile.report(
      args["method"], p=args["ranks"], n=args["n"], simulated=args["simulated"],
      rows=[(r["stage"], r["module"], r["us"]) for r in profile["rows"]],
      total=profile["total_us"])
  rendered = [bench.format_selection(
                  json.loads(_read(os.path.join(raw, "selection.json")))["rows"]),
              per_rank.table(ranks), *stages.split("\n\n")]
  return ["\n".join(line for line in mine.splitlines() if line.startswith("|"))
          for mine in rendered], ranks


# The drivers whose raw files hold rows beside their table, each known by the fields of its
# rows, with the function that renders them.
ROW_DRIVERS = {"step_time": ({"step_s", "params"}, "format_table"),
               "sharded_step": ({"step_s", "permuted"}, "format_table"),
               "per_rank": ({"one_rank_s"}, "table")}


def _driver_raw():
  """Every raw output of a driver of :data:`ROW_DRIVERS` that has its table beside it, with
  the driver."""
  def driver(raw):
    rows = raw.get("rows")
    if isinstance(rows, list) and rows and isinstance(rows[0], dict):
      return next((name for name, (fields, _) in ROW_DRIVERS.items()
                   if fields <= set(rows[0])), None)
    return None
  return [(path, driver(json.loads(_read(path)))) for path in _raw_with_table(driver)]


@pytest.mark.parametrize("path,driver", _driver_raw(),
                         ids=lambda p: os.path.relpath(p, RESULTS).replace(os.sep, "/")
                         if os.sep in str(p) else str(p))
def test_a_driver_report_re_renders_from_its_rows(path, driver):
  import importlib
  table = getattr(importlib.import_module(f"benchmarks.{driver}"), ROW_DRIVERS[driver][1])
  assert table(json.loads(_read(path))["rows"]) in _read(path[:-5] + ".md")


def test_the_selection_pages_gpu_tables_are_its_raw_files():
  """selection.md's H200 section: the selection, per-rank and stage tables are the ones their
  JSON files render, and every figure quoted in the section's summary is in them."""
  rendered, ranks = _selection_gpu_tables()
  page = _read(os.path.join(RESULTS, "selection.md"))
  copied = _tables(page[page.index("## GPU: one H200"):])
  assert copied == rendered
  one_rank = {(r["n"], r["method"]): r["one_rank_s"] * 1e3 for r in ranks}
  assert f"{one_rank[66_000_000, 'spardl']:.2f} ms at n = 66M" in page
  assert f"at 14.7M it\ntakes {one_rank[14_700_000, 'spardl']:.2f} ms" in page


def test_the_nanogpt_report_re_renders_and_adam_md_copies_it(tmp_path, capsys):
  """The nanoGPT case's report (both tables) from the variants' raw results, and adam.md's
  copies of its tables, line for line."""
  from benchmarks import convergence
  folder = os.path.join(RESULTS, "adam", "nanogpt")
  dirs = sorted(d for d in glob.glob(os.path.join(folder, "*")) if os.path.isdir(d)
                and os.path.basename(d) != "table")
  assert convergence.main(["--cases", "shakespeare_nanogpt", "--on", "loss", "--target",
                           "0.98", "--report", ",".join(dirs), "--out", str(tmp_path)]) == 0
  capsys.readouterr()
  rendered = _read(str(tmp_path / "results.md"))
  assert rendered == _read(os.path.join(folder, "table", "results.md"))
  page = _tables(_read(os.path.join(RESULTS, "adam.md")))
  for table in _tables(rendered):
    assert table in page, table.splitlines()[:3]


def _convergence_raw():
  """Every ``benchmarks.convergence`` ``results.json`` with the ``results.md`` it wrote."""
  return sorted(os.path.dirname(path)
                for path in glob.glob(os.path.join(RESULTS, "**", "results.json"), recursive=True)
                if os.path.isfile(os.path.join(os.path.dirname(path), "results.md"))
                and _convergence_rows(json.loads(_read(path))))


def _convergence_rows(raw):
  rows = raw.get("rows") if isinstance(raw, dict) else None
  return rows if (isinstance(rows, list) and rows and isinstance(rows[0], dict)
                  and {"fraction", "curves"} <= set(rows[0])) else None


def _convergence_report(folder, tmp):
  """``python -m benchmarks.convergence --report FOLDER`` at the targets its rows record
  (a loss target where its report says one), written under ``tmp``."""
  from benchmarks import convergence
  rows = _convergence_rows(json.loads(_read(os.path.join(folder, "results.json"))))
  on = "loss" if _read(os.path.join(folder, "results.md")).startswith("Target: 1") else "metric"
  targets = ",".join(str(f) for f in dict.fromkeys(r["fraction"] for r in rows))
  with contextlib.redirect_stdout(io.StringIO()):
    assert convergence.main(["--report", folder, "--target", targets, "--on", on,
                             "--out", str(tmp), "--no-plot"]) == 0
  return _read(os.path.join(str(tmp), "results.md"))


@pytest.mark.parametrize("folder", _convergence_raw(), ids=lambda p: os.path.relpath(p, RESULTS))
def test_a_convergence_report_re_renders_from_its_raw_file(folder, tmp_path):
  assert _convergence_report(folder, tmp_path) == _read(os.path.join(folder, "results.md"))


@functools.cache
def _rendered_reports() -> tuple[str, ...]:
  """Every report a page may copy a table from, rendered now from its raw files (the tests
  above hold each to the file beside it): a page's copy is held to the raw files, never to
  a report that could have been edited with it. Rendered once per test process: the tests
  that read it share one (``xdist_group``)."""
  with tempfile.TemporaryDirectory() as tmp:
    return tuple(_render_reports(pathlib.Path(tmp)))


def _render_reports(tmp):
  from benchmarks import overlap, time_to_accuracy, versus
  from train import report
  texts = [_read(os.path.join(RESULTS, "scale", "paper_compare.md"))]  # held above
  for path in TTA:
    raw = json.loads(_read(path))
    text = scale.report([runs.RowAtP.from_json(r) for r in raw["steps"]], raw["times"],
                        raw["first"], fraction=raw["args"]["target"], title=raw["title"])
    sensitivity = {float(k): v for k, v in raw.get("first_at_alpha", {}).items()}
    texts.append(text + (scale.alpha_table(raw["first"], sensitivity) if sensitivity else ""))
  for path in glob.glob(os.path.join(RESULTS, "**", "metrics.json"), recursive=True):
    if os.path.exists(os.path.join(os.path.dirname(path), "results.md")):
      texts.append(report.format_markdown(json.loads(_read(path))["runs"]))
  for path in PROJECTIONS:
    raw = json.loads(_read(path))
    texts.append(project.fastest_table(raw["rows"], raw["args"]["title"]
                                       or f"n = {raw['args']['n']:,}"))
  import argparse
  for path in OVERLAP:
    raw = json.loads(_read(path))
    texts.append(overlap.table(raw["seconds"], argparse.Namespace(**raw["args"])))
  for path in _raw_with_table(lambda raw: "over_seeds" in raw):
    raw = json.loads(_read(path))
    rows = [time_to_accuracy.Timed.from_json(r) for r in raw["rows"]]
    texts.append(time_to_accuracy.format_table(rows, time_to_accuracy.over_seeds(rows),
                                               type("Args", (), raw["args"])))
  for path in _raw_with_table(lambda raw: "against" in raw.get("args", {})):
    raw = json.loads(_read(path))
    texts.append(versus.report([tuple(r) for r in raw["rows"]], raw["args"]))
  from spardl_jax.tools import bench
  for path in _bench_raw():
    raw = json.loads(_read(path))
    texts.append(bench.report(bench.kind_of(raw["args"]), raw["rows"]))
  from benchmarks import sync_profile
  for path in _profile_raw():
    raw, args = json.loads(_read(path)), json.loads(_read(path))["args"]
    texts.append(sync_profile.report(
        args["method"], p=args["ranks"], n=args["n"], simulated=args["simulated"],
        rows=[(r["stage"], r["module"], r["us"]) for r in raw["rows"]], total=raw["total_us"]))
  import importlib
  for path, driver in _driver_raw():
    table = getattr(importlib.import_module(f"benchmarks.{driver}"), ROW_DRIVERS[driver][1])
    texts.append(table(json.loads(_read(path))["rows"]))
  texts.extend(_selection_gpu_tables()[0])
  for i, folder in enumerate(_convergence_raw()):
    texts.append(_convergence_report(folder, tmp / f"c{i}"))
  texts.extend(_validation(*args) for args in VALIDATIONS)
  texts.extend(_netbench(p) for p in NETBENCH)
  runs_ = os.path.join(RESULTS, "scale", "steps", "delay")
  for target in ("0.95", "0.98"):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      scale.main(["--runs", runs_, "--target", target])
    texts.append(out.getvalue())
  profiles = {label: json.loads(_read(os.path.join(RESULTS, "selection",
                                                   f"profile_cpu_{name}.json")))
              for label, name in (("before", "d02de91"), ("now", "now"))}
  texts.append(sync_profile.compare(profiles))
  return texts


PAGE_READERS = pytest.mark.xdist_group("rendered reports")


# The cost model's validations: (the raw file, its report, python -m benchmarks.project's
# flags), as benchmarks/scripts/network_paced.sh ran them.
VALIDATIONS = (
    ("network/sync_p4/results.json", "network/sync_p4_validation.md",
     ["--processes", "4", "--n", "14.7e6"]),
    ("network/sync_p8/results.json", "network/sync_p8_validation.md",
     ["--processes", "8", "--n", "4e6"]),
    ("network/tta_p8/results.json", "network/tta_p8/validation_seed0.md",
     ["--processes", "8", "--seed", "0"]))


def _validation(raw, md, flags) -> str:
  """``python -m benchmarks.project --validate RAW FLAGS`` as it prints now."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert project.main(["--validate", os.path.join(RESULTS, raw), *flags]) == 0
  return out.getvalue()


NETBENCH = sorted(glob.glob(os.path.join(RESULTS, "network", "sync_p*", "results.json")))


def _netbench(raw) -> str:
  """``python -m benchmarks.netbench``'s table of a run's ``results.json``."""
  from benchmarks import netbench
  return netbench.table(json.loads(_read(raw)))


@pytest.mark.parametrize("raw", NETBENCH, ids=lambda p: p.split(os.sep)[-2])
def test_a_sync_time_report_re_renders_from_its_raw_file(raw):
  """The table netbench printed (its ``.md`` beside the run's folder) is its raw file's."""
  assert _netbench(raw) in _read(os.path.dirname(raw) + ".md")


@pytest.mark.parametrize("raw,md,flags", VALIDATIONS, ids=[v[1] for v in VALIDATIONS])
def test_a_cost_model_validation_re_renders_from_its_raw_file(raw, md, flags):
  assert _validation(raw, md, flags) == _read(os.path.join(RESULTS, md))


PAGES = sorted(glob.glob(os.path.join(RESULTS, "*.md")))
RENDERED_BY = re.compile(r"<!-- rendered: python -m benchmarks\.(convergence|scale) (.+?) -->")
@PAGE_READERS
@pytest.mark.parametrize("page", PAGES, ids=os.path.basename)
def test_every_table_of_a_page_is_rendered_from_raw_files(page, tmp_path, monkeypatch, capsys):
  """A table after a ``<!-- rendered: python -m benchmarks.DRIVER ARGS -->`` comment
  (``convergence``, ``scale``) is one of the tables that command writes now from the
  committed raw files; any other is a table of a report as :func:`_rendered_reports`
  renders it now from its raw files (a report edited with the page does not count). A
  table typed by hand fails."""
  from benchmarks import convergence
  monkeypatch.chdir(ROOT)
  reports = {t for text in _rendered_reports() for t in _tables(text)}
  text, typed = _read(page), []
  for i, match in enumerate(re.finditer(r"(?:^\|.*\n)+", text, re.M)):
    table = match.group(0).strip()
    before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
    command = RENDERED_BY.fullmatch(before)
    if command and command.group(1) == "convergence":  # it writes its tables under --out
      out = tmp_path / str(i)
      assert convergence.main([*command.group(2).split(), "--out", str(out), "--no-plot"]) == 0
      capsys.readouterr()
      assert table in _tables(_read(str(out / "results.md"))), table.splitlines()[:3]
    elif command:  # scale prints them
      scale.main(command.group(2).split())
      assert table in _tables(capsys.readouterr().out), table.splitlines()[:3]
    elif table not in reports:
      typed.append(table.splitlines()[0])
  assert typed == [], (
      f"{os.path.basename(page)}: tables typed by hand (render each from its raw files, "
      f"with a <!-- rendered: ... --> comment above it, or copy a driver's report): {typed}")


def test_every_plot_kept_is_shown_by_a_page_and_every_shown_plot_is_kept():
  """benchmarks/results keeps the plots its pages show and no other (a driver draws one
  beside each raw file, which holds the same; the .gitignore keeps the rest out): each
  ``![...](path)`` of a page names a tracked file here, and each tracked image here is one a
  page names."""
  shown = {os.path.normpath(os.path.join(RESULTS, path)) for page in PAGES
           for path in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", _read(page))}
  tracked = subprocess.run(["git", "ls-files", "*.png"], cwd=RESULTS, capture_output=True,
                           text=True, check=True).stdout.split()  # not a driver's fresh plot
  images = {os.path.normpath(os.path.join(RESULTS, p)) for p in tracked}
  assert shown <= images, sorted(shown - images)
  assert images <= shown, sorted(images - shown)


def test_every_figure_the_results_index_quotes_is_on_its_page():
  """docs/results.md says what each page found: every figure of a page's row (a decimal, a
  ratio ``N×``, a percentage, ``N of M``) is written on that page, so the index cannot drift
  from it."""
  index = _read(os.path.join(ROOT, "docs", "results.md"))
  rows = re.findall(r"^\| \[(\w+\.md)\]\(\.\./benchmarks/results/\1\) \|[^|]*\|[^|]*\| (.*) \|$",
                    index, re.M)
  assert {page for page, _ in rows} == {os.path.basename(p) for p in PAGES}
  for page, found in rows:
    text = _read(os.path.join(RESULTS, page))
    figures = re.findall(r"\d[\d,]*\.\d+|\d[\d,]*(?=×)|\d+(?= ?%)|\d+ of \d+", found)
    assert [f for f in dict.fromkeys(figures) if f not in text] == [], page


def _claims(text):
  """The README's and the guides' units of claim: each table row, and each sentence of the
  prose around the code blocks, as text."""
  text = re.sub(r"```.*?```", "", text, flags=re.S)
  units = [line for line in text.splitlines() if line.startswith("|")]
  prose = " ".join(line for line in text.splitlines() if not line.startswith("|"))
  # A sentence ends at "." or ";" (bold closing after it included) before a space.
  return units + re.split(r"(?<=[.;])\**\s+", prose)


# A figure with what makes it one: a share "1/15.2", a ratio "1.08×", a percentage "63 %".
FIGURE = re.compile(r"1/\d[\d,]*(?:\.\d+)?|\d[\d,]*(?:\.\d+)?×|\d+(?:\.\d+)? ?%|\d[\d,]*\.\d+")


def _held(claim, figure):
  """Whether a page's claim (a sentence, a table row) writes ``figure``: as it is (a
  percentage with or without its space), or in a table row bare (its cells hold "2.69"
  under a "× dense" header)."""
  if claim.startswith("|"):
    bare = re.sub(r"^1/|[×%\s]", "", figure)
    return figure in claim or bare in re.split(r"[\s|(),×%]+", claim)
  return figure in claim or figure.replace(" %", "%") in claim or (
      figure.endswith("%") and figure[:-1].rstrip() + " %" in claim)


def _unquoted(text, pages):
  """Where ``text`` quotes figures that no one sentence or table row of the results page it
  cites holds together: ``(page, figures)`` for every unit (a row, a sentence) of ``text``
  that cites a page, so that a figure changed, or taken from another claim of the page,
  is found."""
  wrong = []
  for unit in _claims(text):
    figures = tuple(dict.fromkeys(FIGURE.findall(re.sub(r"`[^`]*`", "", unit))))  # not code
    for page in dict.fromkeys(re.findall(r"\(benchmarks/results/(\w+\.md)", unit)):
      if figures and not any(all(_held(claim, f) for f in figures)
                             for claim in _claims(pages[page])):
        wrong.append((page, figures))
  return wrong


def test_every_figure_the_readme_quotes_is_on_the_page_it_cites():
  """Each README row or sentence that cites a results page quotes only figures written on
  that page (not on some other page, as a substring anywhere)."""
  pages = {os.path.basename(p): _read(p) for p in PAGES}
  readme = _read(os.path.join(ROOT, "README.md"))
  assert len([u for u in _claims(readme) if "(benchmarks/results/" in u]) >= 5
  assert _unquoted(readme, pages) == []


def test_the_readme_check_sees_a_figure_moved_or_changed():
  pages = {"a.md": "It ends at 1.526 at 1/15.2 of the bytes, 63 %. Another at 1/15.8.",
           "b.md": "1/15.8 and 83 %"}
  good = "| x | 1.526 at 1/15.2, 63 % | [a.md](benchmarks/results/a.md) |\n"
  assert _unquoted(good, pages) == []
  assert _unquoted(good.replace("63 %", "83 %"), pages) == [("a.md", ("1.526", "1/15.2",
                                                                       "83 %"))]
  assert _unquoted(good.replace("15.2", "15.8"), pages) == [("a.md", ("1.526", "1/15.8",
                                                                       "63 %"))]
  assert _unquoted("It ends at 1.536 ([a](benchmarks/results/a.md)). Fine 9.9.", pages) == [
      ("a.md", ("1.536",))]


# Figures of a page's prose that no table of it and no report holds: derived (a ratio of two
# table entries, a parameter count) or from a run whose table the page does not show. Every
# other decimal of a page's prose must stand in one of its tables or in a report rendered
# from raw files, so that a figure edited in the prose alone fails.
UNHELD = {
    'adam.md': {'2.311', '0.525', '3.07', '1.879', '1.023', '1.011', '1.025', '1.047', '1.106', '0.379',
        '1.713', '1.682', '1.584', '1.576', '1.559', '1.545', '0.207', '2.635', '1.741',
        '3.195', '2.890', '3.005', '2.649', '2.646', '2.041', '2.231', '2.309', '1.986',
        '2.026', '1.736', '17.5', '1.798', '2.416', '2.113', '2.493', '2.465', '2.441'},
    'cpu_profile.md': {'4.35', '0.139'},
    'network.md': {'0.881', '0.68', '2.441', '1.841', '4.35', '88.2', '0.49'},
    'outer.md': {'0.9605', '0.436', '4.35', '0.1555'},
    'scale.md': {'580.159', '58.8', '0.224', '0.210', '0.150', '4.35', '5.10', '0.0325'},
    'selection.md': {'3.89', '0.267', '0.413', '0.568', '580.159'},
    'sync_methods.md': {'0.5004', '5.34', '1.74', '6,14.7'},
    'training.md': {'33.8', '0.451', '0.746', '0.539', '0.432', '0.259', '0.9603', '0.9587', '0.462',
        '0.788', '0.899', '0.809'},
}


@PAGE_READERS
def test_every_prose_figure_of_a_page_is_in_its_tables_or_reports():
  rendered = "\n".join(_rendered_reports())
  wrong, stale = {}, {}
  for page in PAGES:
    name = os.path.basename(page)
    text = re.sub(r"```.*?```", "", _read(page), flags=re.S)
    lines = text.splitlines()
    tables = "\n".join(line for line in lines if line.startswith("|"))
    prose = "\n".join(line for line in lines if not line.startswith(("|", "<!--")))
    figures = set(re.findall(r"\d[\d,]*\.\d+", prose))
    held = UNHELD.get(name, set())
    wrong[name] = sorted(f for f in figures - held if f not in tables and f not in rendered)
    stale[name] = sorted(held - figures)
  assert {k: v for k, v in wrong.items() if v} == {}
  assert {k: v for k, v in stale.items() if v} == {}  # an exemption no prose needs any more
