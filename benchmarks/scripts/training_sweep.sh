#!/usr/bin/env bash
# The MNIST-1D sweeps behind the recipe's choices (benchmarks/results/training.md, "Sweeps
# behind the choices"): the main job, 8 simulated devices, seeds 0 and 1 (run side by side),
# each `--compare` spec with the paper's plain SparDL tuning underneath (`--recipe paper`),
# then dense and the recipe's momentum under a cosine schedule in a folder of their own (a
# spec's label does not say its schedule). Tables: `python -m benchmarks.scale --runs FOLDER
# --target 0.95,0.98`.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=benchmarks/results/training/sweep
SPECS="dense,dense:lr=0.1,dense:lr=0.2,dense:opt_momentum=0.7,spardl,spardl:opt_momentum=0.7,\
spardl:opt_momentum=0.5,spardl:opt_momentum=0.5:lr=0.3,spardl:opt_momentum=0.5:lr=0.5,\
spardl:opt_momentum=0,spardl:opt_momentum=0.7:warmup=31,spardl:opt_momentum=0.5:ramp=31,\
spardl:opt_momentum=0.5:ramp=62,spardl:momentum=0.9,spardl:momentum=0.9:masking=0,\
spardl:warmup=15"
for seed in 0 1; do
  [ -f $R/constant/s$seed/metrics.json ] || python -m train --recipe paper --devices 8 --epochs 30 \
      --seed $seed --no-progress --compare "$SPECS" --out $R/constant/s$seed &
done
wait
for seed in 0 1; do
  [ -f $R/cosine/s$seed/metrics.json ] || python -m train --recipe paper --devices 8 --epochs 30 \
      --seed $seed --no-progress --lr-schedule cosine --compare "dense,spardl:opt_momentum=0.5" \
      --out $R/cosine/s$seed &
done
wait
