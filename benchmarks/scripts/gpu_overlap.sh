#!/usr/bin/env bash
# Does a delayed sync's transfer run under the compute on GPUs? One call, under 8 minutes, on a
# machine with two or more GPUs (benchmarks/overlap.py --in-process: compute alone, SparDL's
# sync alone, the two in one program with and without a data dependence, and as two programs),
# with XLA's latency-hiding scheduler off and on, each with a jax.profiler trace (open it in
# Perfetto or TensorBoard: the collective-permutes of the "independent" step should sit under
# its matmuls). Writes OUT/lhs_<false|true>/{results.json,results.md,trace/} and OUT/overlap.md.
set -eu
cd "$(dirname "$0")/../.."
out=${1:-gpu_overlap_out}
mkdir -p "$out"
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true; git rev-parse HEAD; } \
  > "$out/machine.txt" 2>&1
gpus=$(python -c "import jax; print(jax.device_count())")
if [ "$gpus" -lt 2 ]; then
  echo "$gpus device: a sync over one device sends nothing, so there is no transfer to hide." \
    | tee "$out/overlap.md"
  exit 0
fi
: > "$out/overlap.md"
for lhs in false true; do
  XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=$lhs ${XLA_FLAGS:-}" \
    timeout 200 python -m benchmarks.overlap --in-process --n 64e6 --density 0.01 \
    --layers 24 --batch 8192 --width 4096 --repeats 20 --out "$out/lhs_$lhs" \
    --profile "$out/lhs_$lhs/trace"
  { echo "latency-hiding scheduler: $lhs"; cat "$out/lhs_$lhs/results.md"; echo; } \
    >> "$out/overlap.md"
done
cat "$out/overlap.md"
