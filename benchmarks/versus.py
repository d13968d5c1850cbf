"""Every method's sync now against the same sync at an earlier commit, interleaved in one run.

python -m benchmarks.versus --against d02de91 --devices 8 --n 14.7e6 --methods spardl,oktopk

Timings on this 2-core machine swing by up to 2x between runs, so a change is judged against
its past in one process: the library at ``--against`` is extracted (``git archive``) into a
temporary folder as a package of another name, both versions' syncs of every method are
compiled on the same ``--devices`` simulated CPU devices, and ``--repeats`` rounds call each
of them once in turn (state fed back, as in training), beside a raw ``psum`` of the same
vector. It prints the median seconds per sync of each, and its ratio to ``psum``.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

from benchmarks.cli import add_progress
from spardl_jax.tools.progress import bar
from spardl_jax.tools.provenance import provenance

_OLD = "spardl_then"  # the earlier library's package name in the run


def extract(commit: str, folder: str) -> None:
  """``spardl_jax`` at ``commit``, as the package :data:`_OLD` under ``folder``."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  archive = subprocess.run(["git", "archive", commit, "spardl_jax"], check=True,
                           capture_output=True, cwd=root).stdout
  with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
    for member in tar.getmembers():
      if not member.isfile():
        continue
      text = tar.extractfile(member).read().decode().replace("spardl_jax", _OLD)
      path = os.path.join(folder, member.name.replace("spardl_jax", _OLD, 1))
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "w") as f:
        f.write(text)


def run(args) -> list[tuple[str, float]]:
  import jax
  import numpy as np
  from jax.sharding import PartitionSpec as P

  from spardl_jax import distributed

  # Each version through its own public face (the earlier ones had every piece in
  # sj.methods; the spec reader is sj.options' and the row runners sj.collectives' now).
  versions = {"now": importlib.import_module("spardl_jax"),
              args.against: importlib.import_module(_OLD)}
  mesh = jax.make_mesh((args.devices,), ("data",), devices=jax.devices()[:args.devices],
                       axis_types=(jax.sharding.AxisType.Explicit,))
  x = distributed.shard_rows(np.random.default_rng(0).standard_normal(
      (args.devices, args.n)).astype(np.float32), mesh)
  psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh,
                               in_specs=P("data"), out_specs=P("data")))
  calls = {"psum": [lambda x, state: (psum(x), None), None]}
  for spec in args.methods.split(","):
    for label, face in versions.items():
      def piece(name, where, face=face):
        door = getattr(face, where, None)
        return getattr(door, name) if hasattr(door, name) else getattr(face.methods, name)
      # (method, options) unpacked and made: the earlier version's parse returns a tuple.
      name, options = piece("parse", "options")(spec, density=args.density)
      method = face.methods.make(name, **options)
      rows = piece("init_rows", "collectives")(method, args.devices, args.n)
      calls[f"{spec} ({label})"] = [piece("sharded", "collectives")(method, mesh),
                                    distributed.shard_rows(rows, mesh)]
  times: dict[str, list[float]] = {label: [] for label in calls}
  for rounds in bar(range(args.repeats + 1), desc="rounds", unit="round",
                    enabled=not args.no_progress):  # the first compiles and warms up
    for label, call in calls.items():
      start = time.perf_counter()
      _, call[1] = jax.block_until_ready(call[0](x, call[1]))
      if rounds:
        times[label].append(time.perf_counter() - start)
  return [(label, statistics.median(t)) for label, t in times.items()]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.versus", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--against", required=True, help="the earlier commit")
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--n", type=lambda v: int(float(v)), default=14_700_000)
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--methods", default="spardl,dense,dense_bf16,topka,topkdsa,gtopk,oktopk")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--out", help="a folder for versus.json (the medians) and versus.md")
  add_progress(parser)
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as folder:
    extract(args.against, folder)
    sys.path.insert(0, folder)
    try:
      rows = run(args)
    finally:
      sys.path.remove(folder)
  text = report(rows, vars(args))
  print(text)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "versus.json"), "w") as f:
      json.dump({"args": vars(args), **provenance(), "rows": rows}, f, indent=2)
    with open(os.path.join(args.out, "versus.md"), "w") as f:
      f.write(text + "\n")
  return 0


def report(rows, args: dict) -> str:
  """Every sync's median and its ratio to ``psum``, then one line per method: the earlier
  version's median, today's, their ratio, and today's over ``psum``."""
  seconds = dict(rows)
  base = seconds["psum"]
  lines = [f"median seconds per sync of {args['repeats']}, interleaved; P = {args['devices']} "
           f"simulated devices, n = {args['n']:,}, density {args['density']}",
           "| sync | s | × psum |", "|---|---:|---:|"]
  lines += [f"| {label} | {s:.3f} | {s / base:.2f} |" for label, s in rows]
  lines += ["", f"| method | before ({args['against']}) | now | now / before | now × psum |",
            "| --- | ---: | ---: | ---: | ---: |"]
  for spec in args["methods"].split(","):
    then, now = seconds[f"{spec} ({args['against']})"], seconds[f"{spec} (now)"]
    lines.append(f"| {spec} | {then:.3f} | {now:.3f} | {now / then:.2f} | {now / base:.2f} |")
  return "\n".join(lines)


if __name__ == "__main__":
  import jax

  jax.config.update("jax_num_cpu_devices", 16)  # simulated CPU devices, before any is used
  sys.exit(main())
