"""Bytes and step time of a sharded model's sync (benchmarks/results/cpu_profile.md,
"Sharded models").

python -m benchmarks.sharded_step [--steps 20] [--out DIR]

An MLP of 1.05M parameters (512 -> 1024 -> 512), tensor-parallel over "model": on a
(data=4, model=2) mesh of 8 simulated CPU devices, SparDL at 1 % through
``sj.data_parallel_step`` against dense ``jax.jit`` training of the same sharded model (the
compiler's all-reduce of the mean gradient); and the same model replicated on a one-axis
mesh of 8, SparDL at 1 %. Bytes per device are read from each compiled step's HLO; step
times are medians, the variants interleaved. ``--out`` writes the rows with where they were
measured (``results.json``) and their table (``results.md``).
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import spardl_jax as sj
from benchmarks import runs as run_files
from benchmarks.cli import add_progress
from spardl_jax.tools import traffic
from spardl_jax.tools.progress import bar

AUTO = (jax.sharding.AxisType.Auto,) * 2
SHAPES = {"w1": (512, 1024), "b1": (1024,), "w2": (1024, 512), "b2": (512,)}
TENSOR = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
DENSE = "dense jit, sharded (4 x 2)"


def loss_fn(p, x, y):
  return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)


def place(mesh, specs, seed=0):
  rng = np.random.default_rng(seed)
  return {k: jax.device_put((0.03 * rng.standard_normal(s)).astype(np.float32),
                            NamedSharding(mesh, specs.get(k, P()))) for k, s in SHAPES.items()}


def variants(batch):
  devices = jax.devices()[:8]
  mesh2 = jax.make_mesh((4, 2), ("data", "model"), axis_types=AUTO, devices=devices)
  mesh1 = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                        devices=devices)
  out = {}
  for name, mesh, specs in (("SparDL 1 %, sharded (4 x 2)", mesh2, TENSOR),
                            ("SparDL 1 %, replicated (8)", mesh1, {})):
    tx = optax.chain(sj.spardl(density=0.01), optax.sgd(0.05))
    params = place(mesh, specs)
    state = sj.init_opt_state(tx, params, mesh)
    data = jax.device_put(batch, NamedSharding(mesh, P("data")))
    out[name] = (sj.data_parallel_step(loss_fn, tx, mesh), params, state, data)

  @jax.jit
  def dense(params, state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), state, loss

  out[DENSE] = (dense, place(mesh2, TENSOR), None,
                jax.device_put(batch, NamedSharding(mesh2, P("data"))))
  return out


def format_table(rows: list[dict]) -> str:
  """One line per variant: the bytes each device sends in its compiled step (the sync's
  permutes; all-reduces of more than 1,024 entries, by their operands; all-gathers), the
  median step and its ratio to dense's."""
  base = next(r["step_s"] for r in rows if r["variant"] == DENSE)
  lines = ["| step | permutes B/device (HLO) | all-reduce operands over 1,024 entries (B) "
           "| all-gathers (B) | ms/step | × dense |", "|---|---:|---:|---:|---:|---:|"]
  lines += [f"| {r['variant']} | {r['permuted']:,} | {r['reduced']:,} | {r['gathered']:,} | "
            f"{r['step_s'] * 1e3:.1f} | {r['step_s'] / base:.2f} |" for r in rows]
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.sharded_step", description=__doc__)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--out", help="write results.json and results.md here")
  add_progress(parser)
  args = parser.parse_args(argv)
  rng = np.random.default_rng(1)
  x = rng.standard_normal((256, 512)).astype(np.float32)
  batch = (x, np.tanh(x) * 0.5)
  runs = variants(batch)
  times: dict = {name: [] for name in runs}
  losses, rows = {}, {}
  for name, (step, params, state, data) in runs.items():
    hlo = traffic.parse_hlo(step.lower(params, state, *data).compile().as_text())
    permuted = hlo.bytes_sent(0)
    reduced = sum(c.bytes for c in hlo.others if c.op.startswith("all-reduce")
                  and c.elements > 1024)
    gathered = sum(c.bytes for c in hlo.others if "gather" in c.op)
    rows[name] = {"variant": name, "permuted": permuted, "reduced": reduced,
                  "gathered": gathered}
    print(f"{name}: permutes send {permuted:,} B/device; all-reduces over 1,024 entries "
          f"{reduced:,} B of operands; all-gathers {gathered:,} B")
  for _ in bar(range(args.steps + 2), desc="rounds", unit="round",
               enabled=not args.no_progress):  # interleaved; the first two warm up
    for name, (step, params, state, data) in runs.items():
      start = time.perf_counter()
      params, state, loss = jax.block_until_ready(step(params, state, *data))
      times[name].append(time.perf_counter() - start)
      runs[name], losses[name] = (step, params, state, data), float(loss)
  base = statistics.median(times[DENSE][2:])
  for name, t in times.items():
    m = statistics.median(t[2:])
    rows[name].update(step_s=m, loss=losses[name])
    print(f"{name}: {m * 1e3:.1f} ms/step ({m / base:.2f}x dense), loss {losses[name]:.4f}")
  if args.out:
    meta = {"args": vars(args), "devices": 8, "platform": jax.devices()[0].platform,
            **run_files.provenance()}
    run_files.write_rows(args.out, meta, list(rows.values()), format_table(list(rows.values())))
  return 0


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)  # simulated CPU devices, before any is used
  raise SystemExit(main())
