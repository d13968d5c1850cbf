#!/usr/bin/env bash
# The outer-loop measurements of benchmarks/results/outer.md (8 simulated CPU devices, one process).
set -euo pipefail
cd "$(dirname "$0")/../.."
for h in 10 30 100; do
  python -m benchmarks.convergence --cases mnist1d_cnn1d --variants outer --outer-every "$h" \
      --seeds 0,1 --out "benchmarks/results/outer/mnist1d_h$h"
done
for case in shakespeare_lstm shakespeare_bert; do
  python -m benchmarks.convergence --cases "$case" --variants outer --outer-every 30 --seeds 0 \
      --out "benchmarks/results/outer/${case#shakespeare_}_h30"
done
python -m benchmarks.convergence --cases mnist1d_cnn1d --variants wire --seeds 0,1 \
    --out benchmarks/results/outer/mnist1d_wire
python -m benchmarks.convergence --cases shakespeare_bert --variants diloco,sparseloco \
    --outer-every 30 --outer-momentum 0.9 --seeds 0 --out benchmarks/results/outer/bert_h30_m09
