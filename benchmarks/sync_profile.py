"""Where one sync's compute goes, stage by stage, from a profile of the compiled program.

python -m benchmarks.sync_profile --method spardl --ranks 8 --n 14.7e6 [--calls 3]

Runs the method's sync with ``--ranks`` ranks emulated on one device (``jax.vmap`` with the
method's axis name, as ``spardl-bench --emulate`` does: one program, so no device waits for
another and every instruction's time is its own), records a ``jax.profiler`` trace of
``--calls`` calls, and charges every executed HLO instruction's time to the stage of the algorithm that emitted
it: the compiled program's text maps each instruction to the Python stack that traced it, and
the stage is the outermost frame inside the method's own code (for SparDL the functions
``_stages`` calls: ``spar_reduce_scatter``, ``own_block_selection``, ``gather_team``,
``scatter_result``, ``collect_residual``, ...), with the library module below it that did the
work (``topk.py`` for a selection inside SRS, say). A fusion is charged to the stages of the
instructions fused into it (``a + b`` when it spans two); loops and branches through their
bodies. Emulated collectives are gathers and permutations in memory, listed apart. Times are
per rank and per call: the batched call's time divided by ``P`` and by ``--calls``. Under
``vmap`` a ``lax.cond`` runs both branches (a select), so a method whose rare branch is
costly is profiled as it runs on real devices with ``--simulated`` (CPU devices, one program
each; durations there include the time the 2 cores are shared).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

from spardl_jax.tools.provenance import provenance

# The method's own code: the first frame below these (or below a method's ``*_allreduce``
# function) is the stage.
_ENTRY = ("_stages", "spardl_allreduce", "apply", "step")
_COLLECTIVES = ("collective-permute", "all-reduce", "all-gather", "all-to-all",
                "reduce-scatter", "collective-broadcast")
_CONTAINERS = ("while", "conditional", "call")


def _tables(text: str):
  """``(instructions, stack)``: each instruction's opcode and stack frame id, and a function
  from a stack frame id to its frames ``[(file, function), ...]``, innermost first."""
  def section(name: str) -> dict[int, str]:
    match = re.search(rf"^{name}\n((?:\d+ .*\n)+)", text, flags=re.M)
    return {int(i): rest for i, rest in re.findall(r"^(\d+) (.*)$", match.group(1), re.M)
            } if match else {}

  files = {i: os.path.basename(v.strip('"')) for i, v in section("FileNames").items()}
  functions = {i: v.strip('"') for i, v in section("FunctionNames").items()}
  locations = {i: (files[int(re.search(r"file_name_id=(\d+)", v).group(1))],
                   functions[int(re.search(r"function_name_id=(\d+)", v).group(1))])
               for i, v in section("FileLocations").items()}
  frames = {i: (int(re.search(r"file_location_id=(\d+)", v).group(1)),
                int(re.search(r"parent_frame_id=(\d+)", v).group(1)))
            for i, v in section("StackFrames").items()}

  def stack(frame: int) -> list[tuple[str, str]]:
    out = []
    while frame in frames:
      location, parent = frames[frame]
      out.append(locations[location])
      frame = parent - 1  # the text prints a frame's parent id plus one (0: none)
    return out

  instructions = {}
  for name, opcode, frame in re.findall(
      r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\(.*?stack_frame_id=(\d+)", text, re.M):
    instructions[name] = (opcode, int(frame))
  return instructions, stack


def stage_of(frames: list[tuple[str, str]]) -> tuple[str, str]:
  """``(stage, module)``: the outermost function below the method's entry, and the innermost
  library module of the stack."""
  if not frames:
    return "?", "?"
  for i, (_, function) in enumerate(frames):  # the innermost entry frame
    name = function.split(".")[-1]
    if name in _ENTRY or name.endswith("_allreduce") or function.endswith("<locals>.step"):
      return frames[max(i - 1, 0)][1], frames[0][0]
  return frames[0][1], frames[0][0]


def _fused_frames(text: str) -> dict[str, set[int]]:
  """Each fused computation's stack frame ids (what was fused into it)."""
  out: dict[str, set[int]] = {}
  for name, body in re.findall(r"^%([\w.\-]+) \(.*?\) -> .*? \{\n(.*?)^\}", text, re.M | re.S):
    out[name] = {int(f) for f in re.findall(r"stack_frame_id=(\d+)", body)}
  return out


def profile(method_spec: str, *, p: int, n: int, calls: int, density: float = 0.01,
            simulated: bool = False):
  """``(rows, total_us)``: per (stage, module) the microseconds per rank and call."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from spardl_jax import collectives, options

  jax.config.update("jax_traceback_in_locations_limit", -1)  # whole stacks in the HLO
  method = options.parse(method_spec, density=density).build(p)
  x = jax.random.normal(jax.random.key(0), (p, n))
  state = jax.tree.map(lambda a: jax.numpy.broadcast_to(a, (p, *a.shape)),
                       method.init(n=n, dtype=x.dtype, p=p))
  if simulated:  # P devices, each its own program (its collectives wait for the others)
    mesh = jax.make_mesh((p,), ("data",), devices=jax.devices()[:p],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    x, state = jax.device_put((x, state), NamedSharding(mesh, P("data")))
    fn = collectives.sharded(method, mesh, nonfinite="propagate")
  else:
    fn = jax.jit(jax.vmap(lambda x, s: method.apply(x, s, axis_name="data"),
                          axis_name="data"))
  compiled = fn.lower(x, state).compile()
  text = compiled.as_text()
  instructions, stack = _tables(text)
  fused = _fused_frames(text)
  calls_of = dict(re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? fusion\(.*?calls=%([\w.\-]+)",
                             text, re.M))
  _, state = jax.block_until_ready(compiled(x, state))  # warm-up
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder):
      for _ in range(calls):
        _, state = jax.block_until_ready(compiled(x, state))
    trace = sorted(glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True))
    with gzip.open(trace[-1]) as f:
      events = json.load(f)["traceEvents"]
  spent: collections.Counter = collections.Counter()
  for event in events:
    found = instructions.get(event.get("name", ""))
    if event.get("ph") != "X" or found is None or found[0] in _CONTAINERS:
      continue
    opcode, frame = found
    if opcode.startswith(_COLLECTIVES):
      spent["communication", opcode] += event["dur"]
      continue
    frames = fused.get(calls_of.get(event["name"], ""), set()) or {frame}
    stages = sorted({stage_of(stack(f)) for f in frames})
    spent[" + ".join(s for s, _ in stages), " + ".join(sorted({m for _, m in stages}))] += (
        event["dur"])
  scale = 1.0 / (p * calls)
  rows = [(stage, module, us * scale) for (stage, module), us in spent.most_common()]
  return rows, sum(us for _, _, us in rows)


def coarse(rows) -> list[tuple[str, float]]:
  """The rows summed by stage alone: a fused instruction spanning several stages goes to the
  first of them in the method's order (SparDL's stages, then anything else)."""
  order = ("spar_reduce_scatter", "own_block_selection", "spar_all_gather", "gather_team",
           "scatter_result", "collect_residual", "_stages", "communication")
  sums: collections.Counter = collections.Counter()
  for stage, _, us in rows:
    names = stage.split(" + ")
    sums[next((o for o in order if o in names), names[0])] += us
  return sums.most_common()


def report(method_spec: str, *, p: int, n: int, simulated: bool, rows, total: float) -> str:
  """The profile's two tables (by stage, by fused instruction), as printed and published."""
  ranks = "simulated devices" if simulated else "ranks emulated on one device"
  lines = [f"{method_spec}, P = {p} {ranks}, n = {n:,}: {total / 1e3:.2f} ms per rank and "
           "call in all", "| stage | ms per rank | share |", "|---|---:|---:|"]
  lines += [f"| {stage} | {us / 1e3:.3f} | {us / total:.1%} |" for stage, us in coarse(rows)]
  lines += ["", "| instructions of (fused) | module | ms per rank | share |", "|---|---|---:|---:|"]
  lines += [f"| {stage} | {module} | {us / 1e3:.3f} | {us / total:.1%} |"
            for stage, module, us in rows]
  return "\n".join(lines)


def compare(profiles: dict[str, dict]) -> str:
  """Stage by stage (:func:`coarse`), ms per rank and call, of ``--out`` files side by
  side: one column per label, the stages in the first file's order, those under 0.05 ms in
  every file left out."""
  sums = {label: dict(coarse([(r["stage"], r["module"], r["us"]) for r in raw["rows"]]))
          for label, raw in profiles.items()}
  stages = [stage for stage in dict.fromkeys(s for column in sums.values() for s in column)
            if any(column.get(stage, 0.0) >= 50 for column in sums.values())]
  lines = ["| stage | " + " | ".join(profiles) + " |", "|---" + "|---:" * len(profiles) + "|"]
  lines += [f"| {stage} | " + " | ".join(f"{sums[label].get(stage, 0.0) / 1e3:.1f}"
                                          for label in profiles) + " |" for stage in stages]
  lines.append("| in all | " + " | ".join(f"{raw['total_us'] / 1e3:.1f}"
                                           for raw in profiles.values()) + " |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.sync_profile",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--method", default="spardl", help="a method spec, e.g. spardl:wire=exact")
  parser.add_argument("--ranks", type=int, default=8)
  parser.add_argument("--simulated", action="store_true",
                      help="the ranks as simulated CPU devices, each running its own program "
                           "(a method's cond branches as they run; its collectives' times "
                           "include waiting, and 2 cores share the devices' threads)")
  parser.add_argument("--n", type=lambda v: int(float(v)), default=14_700_000)
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--calls", type=int, default=3)
  parser.add_argument("--out", help="a JSON file for the rows")
  parser.add_argument("--compare", metavar="LABEL=FILE,...",
                      help="print the stages of earlier --out files side by side, and run "
                           "nothing")
  args = parser.parse_args(argv)
  if args.compare:
    pairs = [part.partition("=") for part in args.compare.split(",")]
    if any(not sep or not label or not path for label, sep, path in pairs):
      parser.error(f"--compare {args.compare!r}: give LABEL=FILE pairs, e.g. "
                   f"before=a.json,now=b.json")
    profiles = {}
    for label, _, path in pairs:
      with open(path) as f:
        profiles[label] = json.load(f)
    print(compare(profiles))
    return 0
  rows, total = profile(args.method, p=args.ranks, n=args.n, calls=args.calls,
                        density=args.density, simulated=args.simulated)
  print(report(args.method, p=args.ranks, n=args.n, simulated=args.simulated, rows=rows,
               total=total))
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"args": vars(args), **provenance(), "total_us": total,
                 "rows": [{"stage": s, "module": m, "us": u} for s, m, u in rows]}, f, indent=2)
  return 0


if __name__ == "__main__":
  import jax

  jax.config.update("jax_num_cpu_devices", 16)  # for --simulated, before any device is used
  sys.exit(main())
