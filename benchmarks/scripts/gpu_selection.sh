#!/usr/bin/env bash
# The GPU figures of the selection issue, in one run on one fresh GPU machine (about 6 minutes
# on an H200 on 2026-11-28; its parts' time limits add up to 10):
#   1. the selection alone: SparDL's count, radix (the GPU's default now) and sort methods against
#      lax.top_k and one dense pass, n = 1.84M, 14.7M, 66M at 1 % and 0.1 % (exactness checked);
#   2. every method's sync, one rank's program timed alone (collectives replayed from a batched
#      run, result checked bit for bit) beside the batched emulation over P: n = 14.7M and 66M,
#      P = 8;
#   3. SparDL's sync stage by stage (the profile of the emulated ranks), n = 14.7M, P = 8;
#   4. the compiled sync on the GPU holds no sort and no TopK (the GPU's own lowering).
# Run from the repository root: bash benchmarks/scripts/gpu_selection.sh OUTDIR. The machine needs
# jax with CUDA, optax, flax and tqdm; wheels in .whl/ are installed when present
# (gpu_setup.sh). Each part has its own time limit and writes its results when it ends.
set -u
source benchmarks/scripts/gpu_setup.sh "$@"
timeout 120 python3 -m spardl_jax.tools.bench --selection --n 1.84e6,14.7e6,66e6 \
  --densities 0.01,0.001 --repeats 7 --out "$out/selection" 2>&1 | grep -v '^WARNING' \
  | tee "$out/selection.log"
# One limit a size: on an H200 (2026-11-28) 14.7M took 96 s and 66M 210 s.
for n in 14.7e6 66e6; do
  timeout $([ $n = 66e6 ] && echo 240 || echo 150) python3 -m benchmarks.per_rank --ranks 8 --n $n \
    --methods dense,dense_bf16,spardl,spardl:wire=exact,oktopk,topka,topkdsa --repeats 7 \
    --out "$out/per_rank_$n.json" 2>&1 | grep -v '^WARNING' | tee "$out/per_rank_$n.log"
done
timeout 60 python3 -m benchmarks.sync_profile --ranks 8 --n 14.7e6 --calls 5 \
  --out "$out/profile.json" 2>&1 | grep -v '^WARNING' | tee "$out/profile.log"
timeout 60 python3 - <<'EOF' 2>&1 | grep -v '^WARNING' | tee "$out/hlo.log"
import jax, jax.numpy as jnp
from spardl_jax import methods
p, n = 8, 14_700_000
for spec in ("spardl", "spardl:wire=exact"):
  name, options = methods.parse(spec, density=0.01)
  m = methods.make(name, **options)
  state = jax.tree.map(lambda a: jnp.broadcast_to(a, (p, *a.shape)),
                       m.init(n=n, dtype=jnp.float32, p=p))
  fn = jax.jit(jax.vmap(lambda x, s: m.apply(x, s, axis_name="data"), axis_name="data"))
  text = fn.lower(jax.ShapeDtypeStruct((p, n), jnp.float32), state).compile().as_text()
  print(spec, "default method:", methods.default_selection(), "sorts:", text.count(" sort("),
        "TopK:", text.count('custom_call_target="TopK"'), "while loops:", text.count(" while("))
EOF
