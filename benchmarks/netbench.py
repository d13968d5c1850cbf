"""All-reduce wall time over an emulated cluster network (Linux, root).

``sudo python -m benchmarks.netbench --rates 1gbit,100mbit --n 14.7e6``

Builds ``P`` network namespaces, each with one veth link into a bridge, every link shaped
with ``tc qdisc ... tbf rate R`` (what a namespace sends is limited to ``R``), and runs one
JAX process per namespace (``jax.distributed`` + gloo over those links, one CPU device
each). In one run it times every method, interleaved (repeat r runs each method once), at
each rate, feeding each method's state back as training does (after one warm-up step), and
prints the median wall time per sync, the ratios to SparDL (``spardl``, the compact wire
format) and the bytes per device (the busiest device's, from each method's formula, which
the traffic tests hold to the compiled HLO). The processes
share this machine's cores, so compute is slower than on separate hosts; the network is the
emulated part. Everything is torn down at the end (also on failure). Not part of CI.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

__all__ = ['BRIDGE', 'SUBNET', 'DEFAULT_METHODS', 'MIN_TBF_BURST', 'rate_bits', 'kernel_hz',
           'tbf_burst', 'shaper_record', 'network', 'UNSHAPED', 'shape', 'launch_where',
           'run_job', 'each_rate', 'run_workers', 'worker', 'job_parser', 'main']

BRIDGE = "spdlbr0"
SUBNET = "10.77.0"
DEFAULT_METHODS = ["dense", "dense_bf16", "spardl", "spardl:wire=exact", "spardl:teams=2",
                   "topka", "topkdsa", "gtopk", "oktopk"]


def _sh(*cmd: str, ns: str | None = None) -> None:
  full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
  subprocess.run(full, check=True, capture_output=True)


@contextlib.contextmanager
def network(p: int):
  """``p`` namespaces ``spdl0..`` on a bridge, addresses 10.77.0.1.. ; removed on exit."""
  try:
    _sh("ip", "link", "add", BRIDGE, "type", "bridge")
    _sh("ip", "addr", "add", f"{SUBNET}.254/24", "dev", BRIDGE)
    _sh("ip", "link", "set", BRIDGE, "up")
    for i in range(p):
      ns = f"spdl{i}"
      _sh("ip", "netns", "add", ns)
      _sh("ip", "link", "add", f"spdlv{i}", "type", "veth", "peer", "name", f"spdlb{i}")
      _sh("ip", "link", "set", f"spdlv{i}", "netns", ns)
      _sh("ip", "link", "set", f"spdlb{i}", "master", BRIDGE)
      _sh("ip", "link", "set", f"spdlb{i}", "up")
      _sh("ip", "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", f"spdlv{i}", ns=ns)
      _sh("ip", "link", "set", f"spdlv{i}", "up", ns=ns)
      _sh("ip", "link", "set", "lo", "up", ns=ns)
      _resolve_hostname_to(ns, f"{SUBNET}.{i + 1}")
    yield [f"spdl{i}" for i in range(p)]
  finally:
    for i in range(p):
      subprocess.run(["ip", "netns", "del", f"spdl{i}"], capture_output=True)
      shutil.rmtree(f"/etc/netns/spdl{i}", ignore_errors=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def _resolve_hostname_to(ns: str, address: str) -> None:
  """Makes this host's name resolve to ``address`` inside namespace ``ns``.

  gloo's TCP transport binds to the address the host name resolves to; every namespace
  shares the host name, so without this each rank would bind to the same address. ``ip netns
  exec`` bind-mounts ``/etc/netns/<ns>/hosts`` over ``/etc/hosts``: a per-namespace answer
  with no private JAX API.
  """
  os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
  with open(f"/etc/netns/{ns}/hosts", "w") as f:
    f.write(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")


UNSHAPED = "unshaped"
SHAPER = "shaper"  # results.json's record of the shaper, beside the rates

MIN_TBF_BURST = 16 * 1024  # a few packets, for rates so slow that a tick's worth is less


def rate_bits(rate: str) -> float:
  """A tc rate (``100mbit``, ``1gbit``, ``2.5gbit``) in bits per second."""
  scale = {"g": 1e9, "m": 1e6, "k": 1e3}
  number = rate.removesuffix("bit")
  return float(number[:-1]) * scale[number[-1]] if number[-1] in scale else float(number)


def kernel_hz() -> int:
  """The kernel's timer frequency (``CONFIG_HZ``), 100 where the config cannot be read: the
  lowest common one, so a bucket sized from it never loses tokens."""
  try:
    with gzip.open("/proc/config.gz", "rt") as f:
      for line in f:
        if line.startswith("CONFIG_HZ="):
          return int(line.split("=")[1])
  except OSError:
    pass
  return 100


def tbf_burst(rate: str) -> int:
  """The token bucket of the shaper at ``rate``, in bytes: what a namespace may send at once
  before the rate applies. One timer tick's worth of the rate (rate / HZ), the least ``tc``'s
  manual allows, so no message passes more than a tick (4 ms at HZ = 250) ahead of its pace; a
  smaller bucket loses the tokens that arrive between ticks (16 KiB gave dense's ring 52 % of
  1 Gbit/s at 4 processes), and the 4 MiB one before let every sparse sync through unpaced."""
  return max(MIN_TBF_BURST, math.ceil(rate_bits(rate) / 8 / kernel_hz()))


def shape(namespaces: list[str], rate: str) -> None:
  """Limits what every namespace sends to ``rate`` (a tc rate, e.g. 1gbit, 100mbit) with a
  token bucket of :func:`tbf_burst` bytes, or lifts the limit for :data:`UNSHAPED`."""
  for i, ns in enumerate(namespaces):
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", f"spdlv{i}",
                    "root"], capture_output=True)
    if rate == UNSHAPED:
      continue
    _sh("tc", "qdisc", "add", "dev", f"spdlv{i}", "root", "tbf", "rate", rate, "burst",
        str(tbf_burst(rate)), "latency", "400ms", ns=ns)


def shaper_record(rates) -> dict:
  """What results.json keeps of the shaper: each shaped rate's bucket."""
  return {"tbf_burst_bytes": {r: tbf_burst(r) for r in rates if r != UNSHAPED}}


def launch_where(namespaces: list[str] | None) -> dict:
  """:func:`spardl_jax._src.parallel.launch.launch`'s keywords that put rank ``i`` in
  ``namespaces[i]`` with rank 0 as the coordinator (none for ``None``: this host's
  loopback)."""
  if namespaces is None:
    return {}
  return {"host": f"{SUBNET}.1",
          "prefix": lambda rank: ["ip", "netns", "exec", namespaces[rank]]}


def run_job(command: list[str], out: str, *, processes: int, timeout: float,
            namespaces: list[str] | None, rate: str) -> dict:
  """``command`` (a worker that writes its results to ``out`` as JSON) as one job of
  ``processes`` ranks, one per namespace (or on this host's loopback); returns what it
  wrote."""
  from spardl_jax import launch

  if launch.launch(command, processes=processes, timeout=timeout,
                   **launch_where(namespaces)):
    raise SystemExit(f"a worker failed at {rate}")
  with open(out) as f:
    return json.load(f)


def each_rate(processes: int, rates: list[str], local: bool, run) -> dict:
  """``{rate: run(rate, namespaces)}``: with ``local`` one unshaped run on the loopback
  (``namespaces`` None), else every rate in turn over one set of namespaces, shaped."""
  if local:
    return {UNSHAPED: run(UNSHAPED, None)}
  results = {}
  with network(processes) as namespaces:
    for rate in rates:
      shape(namespaces, rate)
      results[rate] = run(rate, namespaces)
  return results


def run_workers(namespaces, args, rate: str) -> dict:
  """One process per namespace (or, with ``--local``, ``--processes`` on this host's
  loopback); returns rank 0's timings."""
  out = os.path.join(args.out, f"times_{rate}.json")
  cmd = [sys.executable, "-m", "benchmarks.netbench", "--worker", "--n", str(args.n),
         "--density", str(args.density), "--repeats", str(args.repeats), "--methods",
         ",".join(args.methods), "--out", out]
  return run_job(cmd, out, processes=args.processes, timeout=args.timeout,
                 namespaces=namespaces, rate=rate)


def worker(args) -> int:
  """One rank: time every method, interleaved, and (rank 0) write the medians."""
  from spardl_jax import distributed
  distributed.initialize()
  import jax
  import numpy as np

  from spardl_jax import collectives, options

  p = jax.device_count()
  mesh = jax.make_mesh((p,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))

  xs = np.random.default_rng(0).standard_normal((p, args.n)).astype(np.float32)
  x = distributed.shard_rows(xs, mesh)
  runs, sent = {}, {}
  for text in args.methods:
    method = options.parse(text, density=args.density).build(p)
    state = distributed.shard_rows(collectives.init_rows(method, p, args.n), mesh)
    fn = collectives.sharded(method, mesh)
    _, state = jax.block_until_ready(fn(x, state))  # compile and warm up (step 0)
    runs[text] = [fn, state]
    sent[text] = method.formula(p=p, n=args.n, itemsize=4).bytes
  times: dict[str, list[float]] = {text: [] for text in args.methods}
  for _ in range(args.repeats):
    for text, run in runs.items():  # the state is fed back, as in training
      start = time.perf_counter()
      _, run[1] = jax.block_until_ready(run[0](x, run[1]))
      times[text].append(time.perf_counter() - start)
  if jax.process_index() == 0:
    with open(args.out, "w") as f:
      json.dump({t: {"seconds": statistics.median(v), "bytes": sent[t]}
                 for t, v in times.items()}, f)
  return 0


def job_parser(prog: str, doc: str | None, *, rates: str, n: int, repeats: int,
               timeout: float, out: str) -> argparse.ArgumentParser:
  """The flags of a benchmark that runs one job of processes per rate over the emulated
  network (this one, ``benchmarks.overlap``), with its defaults."""
  parser = argparse.ArgumentParser(prog=prog, description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--processes", type=int, default=4)
  parser.add_argument("--rates", default=rates, help="tc rates, comma separated")
  parser.add_argument("--n", type=lambda v: int(float(v)), default=n)
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--repeats", type=int, default=repeats)
  parser.add_argument("--timeout", type=float, default=timeout, help="seconds per rate")
  parser.add_argument("--out", default=out)
  parser.add_argument("--local", action="store_true",
                      help="processes on 127.0.0.1: no namespaces, no shaping, no root (a "
                           "smoke run; --rates unshaped)")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  return parser


def table(results: dict) -> str:
  """The Markdown table of ``results`` (``results.json`` less its shaper record: rate ->
  method -> seconds and bytes): each method's bytes, and at each rate its seconds and its
  ratio to SparDL's, the methods in the order they ran."""
  rates = {rate: times for rate, times in results.items() if rate != SHAPER}
  lines = ["| method | bytes/device | " + " | ".join(f"{r} (s) | {r} vs SparDL" for r in rates)
           + " |", "|---|---|" + "---|---|" * len(rates)]
  for text in next(iter(rates.values())):
    cells = [f"{next(iter(rates.values()))[text]['bytes']:,}"]
    for times in rates.values():
      seconds = times[text]["seconds"]
      cells += [f"{seconds:.3f}", f"{seconds / times['spardl']['seconds']:.2f}x"]
    lines.append(f"| {text} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = job_parser("python -m benchmarks.netbench", __doc__, rates="1gbit,100mbit",
                      n=14_700_000, repeats=3, timeout=1800, out="netbench_out")
  parser.add_argument("--methods", default=",".join(DEFAULT_METHODS))
  args = parser.parse_args(argv)
  args.methods = args.methods.split(",")
  rates = args.rates.split(",")
  if "spardl" not in args.methods:
    parser.error(f"--methods must include 'spardl' (the ratios are to it), got {args.methods}")
  if args.local and rates != [UNSHAPED]:
    parser.error(f"--local cannot shape the network: use --rates {UNSHAPED}, got {rates}")
  if args.worker:
    return worker(args)
  if not args.local and os.geteuid() != 0:
    print("netbench needs root (network namespaces and tc); --local runs without them.",
          file=sys.stderr)
    return 2
  os.makedirs(args.out, exist_ok=True)
  args.out = os.path.abspath(args.out)
  results = each_rate(args.processes, rates, args.local,
                      lambda rate, namespaces: run_workers(namespaces, args, rate))
  print(f"wall time per sync (median of {args.repeats}), P = {args.processes} processes, "
        f"n = {args.n:,}, density {args.density}")
  print(table(results))
  with open(os.path.join(args.out, "results.json"), "w") as f:
    shaper = {} if args.local else {SHAPER: shaper_record(results)}
    json.dump({**results, **shaper}, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
