"""Each sync's compute per rank at VGG-16's size on the default device (a GPU, or this
machine's CPU), P = 8 ranks emulated by `jax.vmap` as `spardl-bench --emulate` does,
PowerSGD included with VGG-16's own leaf shapes (the flat-vector bench leaves it out).
Run from the repository root: `python -m benchmarks.vgg16_compute [--out OUT.json]`
(`--model` another model of models/registry.py, e.g. a small one for a smoke run)."""

import argparse
import json
import statistics
import time

import jax
import numpy as np

import spardl_jax as sj
from models import registry

P = 8


def model_shapes(name: str):
  params = registry.abstract_params(registry.create(name), registry.spec(name).example)
  return [tuple(leaf.shape) for leaf in jax.tree.leaves(params)]


def per_rank_seconds(method, n: int, repeats: int) -> float:
  x = jax.random.normal(jax.random.key(0), (P, n))
  state = jax.tree.map(lambda a: jax.numpy.broadcast_to(a, (P, *a.shape)),
                       method.init(n=n, dtype=x.dtype, p=P))
  fn = jax.jit(jax.vmap(lambda x, s: method.apply(x, s, axis_name="data"), axis_name="data"))
  y, _ = jax.block_until_ready(fn(x, state))
  assert np.all(np.asarray(y) == np.asarray(y)[:1]), "ranks disagree"
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(x, state))
    times.append(time.perf_counter() - start)
  return statistics.median(times) / P


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.vgg16_compute",
                                   description=__doc__)
  parser.add_argument("--model", default="vgg16", choices=sorted(registry.MODELS))
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", help="a JSON file for the figures")
  args = parser.parse_args(argv)
  shapes = model_shapes(args.model)
  n = sum(int(np.prod(s)) for s in shapes)
  methods = {"dense": sj.methods.make("dense"),
             "spardl": sj.methods.make("spardl", density=0.01),
             "oktopk": sj.methods.make("oktopk", density=0.01),
             "powersgd": sj.methods.make("powersgd", rank=4).for_leaves(shapes)}
  rows = {name: per_rank_seconds(m, n, args.repeats) for name, m in methods.items()}
  for name, seconds in rows.items():
    print(f"{name}: {seconds * 1e3:.1f} ms per rank ({seconds / rows['spardl']:.2f}x SparDL)")
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "model": args.model, "p": P, "n": n,
                 "per_rank_s": rows}, f, indent=2)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
