"""The least any sparse sync of SparDL's shape can cost on simulated CPU devices, beside psum.

python -m benchmarks.floor_cpu --devices 8 --n 14.7e6

Times, interleaved, on ``--devices`` simulated CPU devices: a raw ``psum`` of the ``(n,)``
vector; the streaming a residual-keeping sync cannot avoid (read the gradient and the
residual, write the result and the new residual: ``g = x + r``, outputs ``g`` and ``g / 2``);
the same with ``2 ceil(log2 P)`` rounds of ``ppermute`` of a 1 % message, SparDL's rounds;
and the syncs of ``--methods``. The differences say what the streaming and the rounds alone
cost on this harness, before any selection: the floor under which SparDL's sync cannot go
here.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from benchmarks.cli import add_progress


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.floor_cpu", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--devices", type=int, default=8)
  parser.add_argument("--n", type=lambda v: int(float(v)), default=14_700_000)
  parser.add_argument("--methods", default="spardl", help="comma list of method specs")
  parser.add_argument("--repeats", type=int, default=7)
  add_progress(parser)
  args = parser.parse_args(argv)
  import jax
  import numpy as np
  from jax.sharding import PartitionSpec as P

  from spardl_jax import distributed
  from spardl_jax import collectives, options
  from spardl_jax.tools.progress import bar

  p, n = args.devices, args.n
  mesh = jax.make_mesh((p,), ("data",), devices=jax.devices()[:p],
                       axis_types=(jax.sharding.AxisType.Explicit,))
  rng = np.random.default_rng(0)
  x = distributed.shard_rows(rng.standard_normal((p, n)).astype(np.float32), mesh)
  r = distributed.shard_rows(rng.standard_normal((p, n)).astype(np.float32), mesh)
  ring = [(i, (i + 1) % p) for i in range(p)]
  message = max(1, n // 100)

  def streaming(x, r, rounds):
    g = x[0] + r[0]
    sent = g[:message]
    for _ in range(rounds):
      sent = jax.lax.ppermute(sent, "data", ring) + 1.0
    return g.at[:message].set(sent)[None], (g / 2)[None]

  def compiled(body):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 2,
                                 out_specs=(P("data"),) * 2, check_vma=False))

  calls = {
      "psum": jax.jit(jax.shard_map(lambda x, r: jax.lax.psum(x, "data"), mesh=mesh,
                                    in_specs=(P("data"),) * 2, out_specs=P("data"))),
      "stream x, r in; result, residual out": compiled(lambda x, r: streaming(x, r, 0)),
      f"the same + {2 * math.ceil(math.log2(p))} rounds of a 1 % message": compiled(
          lambda x, r: streaming(x, r, 2 * math.ceil(math.log2(p)))),
  }
  states = {}
  for spec in args.methods.split(","):
    method = options.parse(spec, density=0.01).build(p)
    sync = collectives.sharded(method, mesh)
    states[spec] = distributed.shard_rows(collectives.init_rows(method, p, n), mesh)

    def call(x, r, spec=spec, sync=sync):
      y, states[spec] = sync(x, states[spec])  # the state fed back, as in training
      return y
    calls[spec] = call
  times: dict[str, list[float]] = {label: [] for label in calls}
  for rounds in bar(range(args.repeats + 1), desc="rounds", unit="round",
                    enabled=not args.no_progress):  # the first compiles
    for label, fn in calls.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(x, r))
      if rounds:
        times[label].append(time.perf_counter() - start)
  base = statistics.median(times["psum"])
  print(f"median seconds of {args.repeats}, interleaved; P = {p} simulated devices, n = {n:,}")
  print("| program | s | × psum |\n|---|---:|---:|")
  for label, t in times.items():
    print(f"| {label} | {statistics.median(t):.3f} | {statistics.median(t) / base:.2f} |")
  return 0


if __name__ == "__main__":
  import jax

  jax.config.update("jax_num_cpu_devices", 16)  # simulated CPU devices, before any is used
  sys.exit(main())
