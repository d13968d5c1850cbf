"""Benchmark: every all-reduce method side by side on simulated CPU devices (its modules:
:mod:`.side_by_side`, :mod:`.emulated`, :mod:`.selection`, :mod:`.pieces`; this one is the
command line).

Usage::

  python -m spardl_jax.tools.bench                                 # all methods, paper sizes
  python -m spardl_jax.tools.bench --devices 8,14 --n 14.7e6 --out bench_out
  python -m spardl_jax.tools.bench --devices 12,14 --n 14.7e6 --methods spardl --teams all
  python -m spardl_jax.tools.bench --methods spardl,dense --n 1e6 --trace bench_out/trace
  python -m spardl_jax.tools.bench --selection --n 1e6,14.7e6 --densities 0.01,0.001
  python -m spardl_jax.tools.bench --emulate --devices 8,16 --n 14.7e6,66e6  # one GPU
  python -m spardl_jax.tools.bench --pieces --n 14.7e6 --repeats 9 --out pieces_out

For each device count ``P``, gradient size ``n`` and method (SparDL once per team count
``d`` and per ``--wire`` format) it reports:

* the rounds and the bytes each device sends, measured from the compiled HLO, next to the
  method's formula (dense ``pmean`` is one all-reduce op: its ring cost is the formula);
* the compute time of one call (median of ``--repeats``, each call waited for, which also
  guards against the CPU rendezvous deadlock of many simulated devices on few cores; the
  state is fed back after a warm-up call, as in training), when the arrays fit in
  ``--max-memory-gb`` (simulated devices share this machine's memory);
* the alpha-beta modeled time ``rounds * alpha + bytes * beta`` for ``--alpha``/``--beta``
  (default 10 Gbit/s Ethernet) and for 100 Gbit/s InfiniBand (``*`` marks the SparDL ``d``
  that ``teams='auto'`` picks);
* the paper's Table 1 (latency and bandwidth cost) evaluated beside the measurement.

B-SAG traffic is read from the branch of the largest message, ``h = kb``, the model's
assumption.

``--selection`` times the selection alone instead, on one device of whatever backend runs
it: SparDL's exact block selection (two stages, with each method of
:mod:`spardl_jax._src.core.topk`) of the top ``k = ceil(density * n)`` of one ``(n,)`` vector,
against ``lax.top_k`` (exact, sorted) and ``lax.approx_max_k`` (approximate, recall target
0.95), plus one dense elementwise pass over the vector (the memory floor), each the median
of ``--repeats`` after a warm-up; ours is checked to return exactly ``lax.top_k``'s index
set. ``--out`` writes the rows with the arguments and where they were measured (the commit,
the machine, the versions, the selection method) as ``results.json`` (``selection.json``,
``emulated.json``), the printed tables beside them as ``results.md`` (``selection.md``,
``emulated.md``), and ``modeled_time.png`` (modeled time vs ``P`` per method). ``--trace``
writes Perfetto traces of a few calls (ui.perfetto.dev).

``--pieces`` times the competitors' pieces one by one on one device (the whole-vector
top-k, the two sparse sums, TopkDSA's split with no region over capacity and with every
entry in one, and the sorts, binary searches and prefix sum they are built from), at
``k = density · n``, interleaved, each the median of ``--repeats`` after a warm-up
(``pieces.json``, ``pieces.md``).

``--emulate`` times the whole sync's compute on ONE device with the ``P`` ranks emulated:
``jax.vmap`` with the method's axis name runs all ranks batched, and its collectives become
gathers and permutations inside the device's memory, so no network is timed. Each method
(and ``psum``, as ``dense``) runs the same way; the table gives the time of the batched call
and that time over ``P``: an estimate of one rank's compute, but not what a rank runs (each
selection is a batch of ``P`` rows, and a ``lax.cond`` runs both branches); the repository's
``python -m benchmarks.per_rank`` times one rank's own program. The results are checked:
every rank's output equal to rank 0's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import jax

from spardl_jax._src.core.config import ETHERNET_10G, SAG_MODES, WIRE_FORMATS
from spardl_jax.tools.bench.common import PAPER_SIZES, flat_methods
from spardl_jax.tools.bench.emulated import format_emulated, run_emulated
from spardl_jax.tools.bench.pieces import format_pieces, run_pieces
from spardl_jax.tools.bench.selection import format_selection, run_selection
from spardl_jax.tools.bench.side_by_side import format_table, format_table1, plot, run
from spardl_jax.tools.provenance import provenance

__all__ = ['flat_methods', 'PAPER_SIZES', 'run', 'run_emulated', 'format_table', 'format_table1',
           'format_emulated', 'plot', 'run_selection', 'format_selection', 'run_pieces',
           'format_pieces', 'report', 'main']


def _parse_sizes(text: str) -> list[int]:
  if text == "paper":
    return list(PAPER_SIZES)
  try:
    sizes = [int(float(v)) for v in text.split(",") if v.strip()]
  except ValueError:
    sizes = []
  if not sizes or min(sizes) < 1:
    raise argparse.ArgumentTypeError(
        f"must be a comma list of positive numbers (or 'paper' for --n), got {text!r}")
  return sizes


def _parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m spardl_jax.tools.bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--devices", type=_parse_sizes, default=[4, 8, 14],
                      help="device counts P, comma separated (default 4,8,14)")
  parser.add_argument("--n", type=_parse_sizes, default=list(PAPER_SIZES),
                      help="gradient sizes, comma separated, or 'paper' (default: the seven "
                           "models of the paper, 14.7e6 ... 133.5e6)")
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--methods", default=",".join(flat_methods()),
                      help=f"comma list from {list(flat_methods())} (default: all)")
  parser.add_argument("--teams", default="1",
                      help="SparDL team counts d: a comma list, or 'all' for every divisor")
  parser.add_argument("--sag", default="auto", choices=SAG_MODES)
  parser.add_argument("--wire", default="exact,compact",
                      help="SparDL message formats, comma separated (default exact,compact)")
  parser.add_argument("--alpha", type=float, default=ETHERNET_10G["alpha"],
                      help="latency per round (s); default 10 Gbit/s Ethernet")
  parser.add_argument("--beta", type=float, default=ETHERNET_10G["beta"],
                      help="seconds per byte; default 10 Gbit/s Ethernet")
  parser.add_argument("--repeats", type=int, default=5, help="timed calls per method")
  parser.add_argument("--max-memory-gb", type=float, default=6.0,
                      help="time a configuration only if its arrays fit in this much memory")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--emulate", action="store_true",
                      help="time each sync on one device with --devices ranks emulated by "
                           "jax.vmap (see above)")
  parser.add_argument("--selection", action="store_true",
                      help="time the top-k selection alone (see above) instead of all-reduces")
  parser.add_argument("--pieces", action="store_true",
                      help="time the competitors' pieces and the operations under them on "
                           "one device (see above) at k = --density · n")
  parser.add_argument("--densities", default="0.01,0.001",
                      help="with --selection: densities, comma separated (default 0.01,0.001)")
  parser.add_argument("--out", help="directory for the rows (results.json), their tables "
                                    "(results.md) and modeled_time.png")
  parser.add_argument("--trace", help="directory for Perfetto traces")
  parser.add_argument("--no-progress", action="store_true",
                      help="no progress bar (drawn only on a terminal; SPARDL_PROGRESS=0 "
                           "for every command)")
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error("--repeats must be >= 1")
  if not 0 < args.density <= 1:  # also NaN
    parser.error(f"--density must be in (0, 1], got {args.density}")
  if args.pieces and args.density > 0.5:  # two rows of k distinct offsets below n
    parser.error(f"--pieces: --density must be at most 0.5, got {args.density}")
  for flag in ("alpha", "beta"):
    if not 0 < getattr(args, flag) < float("inf"):
      parser.error(f"--{flag} must be a positive, finite number, got {getattr(args, flag)}")
  if not 0 <= args.max_memory_gb < float("inf"):  # 0: nothing is timed, only the HLO read
    parser.error(f"--max-memory-gb must be a finite number >= 0, got {args.max_memory_gb}")
  text = args.densities
  try:
    args.densities = [float(d) for d in text.split(",")]
  except ValueError:
    args.densities = []
  if not args.densities or not all(0 < d <= 1 for d in args.densities):
    parser.error(f"--densities must be a comma list of numbers in (0, 1], got {text!r}")
  args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  unknown = sorted(set(args.methods) - set(flat_methods()))
  if unknown:
    parser.error(f"--methods: unknown {unknown}; allowed: {list(flat_methods())}")
  args.wire = [w.strip() for w in args.wire.split(",") if w.strip()]
  if not args.wire or set(args.wire) - set(WIRE_FORMATS):
    parser.error(f"--wire: expected a comma list from {list(WIRE_FORMATS)}, got "
                 f"{','.join(args.wire)!r}")
  if args.teams != "all":
    try:
      args.teams = [int(v) for v in args.teams.split(",")]
    except ValueError:
      parser.error(f"--teams must be a comma list of ints or 'all', got {args.teams!r}")
  return args


def kind_of(args: dict) -> str:
  """Which benchmark wrote a raw file, from its recorded arguments: ``"selection"``,
  ``"pieces"``, ``"emulated"`` or ``"results"`` (:func:`report`'s ``kind``)."""
  return ("selection" if args.get("selection") else "pieces" if args.get("pieces")
          else "emulated" if args.get("emulate") else "results")


def report(kind: str, rows: list[dict]) -> str:
  """The Markdown tables of one benchmark's rows (``kind``: ``"results"``, the side by side
  and the paper's Table 1 beside it; ``"emulated"``; ``"selection"``): what ``main`` prints
  and writes beside the rows, so a page that copies it can be checked against them."""
  if kind == "selection":
    return format_selection(rows)
  if kind == "pieces":
    return format_pieces(rows)
  if kind == "emulated":
    return format_emulated(rows)
  return (f"{format_table(rows)}\n\nThe paper's Table 1 beside the measurement\n\n"
          f"{format_table1(rows)}")


def _finish(args, kind: str, title: str, rows: list[dict]) -> bool:
  """Prints the title and the tables; with ``--out``, writes the rows, the arguments and
  where they were measured (:func:`~spardl_jax.tools.provenance.provenance`) as
  ``KIND.json`` and the tables as ``KIND.md``. False without ``--out``."""
  text = report(kind, rows)
  print(f"{title}\n{text}")
  if not args.out:
    return False
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f"{kind}.json"), "w") as f:
    json.dump({"args": vars(args), **provenance(), "rows": rows}, f, indent=2)
  with open(os.path.join(args.out, f"{kind}.md"), "w") as f:
    f.write(f"{title}\n\n{text}\n")
  return True


def main(argv=None) -> int:
  args = _parse_args(sys.argv[1:] if argv is None else argv)
  kind = kind_of(vars(args))
  if kind != "results":  # one device, whatever the backend
    device = jax.devices()[0].device_kind
    here = f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__}"
    run_kind, title = {
        "selection": (run_selection, f"\nSelection of the top k (one device, {device}, {here}; "
                                     f"median of {args.repeats})"),
        "pieces": (run_pieces, f"The competitors' pieces (one {device} device, {here}; median "
                               f"of {args.repeats}, interleaved)"),
        "emulated": (run_emulated, f"Each sync with P ranks emulated on one {device} (jax "
                                   f"{jax.__version__}), density {args.density}, median of "
                                   f"{args.repeats}"),
    }[kind]
    _finish(args, kind, title, run_kind(args))
    return 0
  # Before JAX starts its CPU backend; ignored on GPU hosts, which use their real devices.
  jax.config.update("jax_num_cpu_devices", max(args.devices))
  rows = run(args)
  machine = (f"{platform.machine()}, {os.cpu_count()} cores, {jax.devices()[0].platform}, "
             f"jax {jax.__version__}")
  if _finish(args, "results", f"All-reduce methods, density {args.density}, median of "
             f"{args.repeats} ({machine}); model alpha={args.alpha:g} s, beta={args.beta:g} "
             f"s/B; * = the d teams='auto' picks", rows):
    plot(rows, os.path.join(args.out, "modeled_time.png"))
  return 0
