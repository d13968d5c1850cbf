#!/usr/bin/env bash
# The islands case of benchmarks/results/islands.md: nanoGPT's baby GPT and recipe
# (shakespeare_nanogpt, AdamW inside, 8 simulated CPU devices in one process) as M islands of
# 8/M devices (python -m train --islands M), at a 600-step horizon (the cosine ending there)
# and at nanoGPT's 2,000. Each part writes its runs under $R and skips a folder that holds
# its metrics already, so a long sequence keeps what finished.
#   islands.sh step      the outer step (Nesterov lr, momentum) and H on seed 0, 600 steps
#   islands.sh compress  the outer syncs at the chosen step, seed 0, 600 steps
#   islands.sh finals    the finalists on three seeds at 600 steps (seed 0: compress), two
#                        sparse syncs under 1/1,000 of the bytes, the every-step recipe
#                        across islands
#   islands.sh long      the 1/100 finalist on three seeds at 2,000 steps
#   islands.sh count     4 and 8 islands at 600 steps
set -euo pipefail
cd "$(dirname "$0")/../.."
R=${R:-benchmarks/results/islands}
NANOGPT="--model nanogpt --dataset shakespeare --batch-size 96 --seq-len 64 --steps-per-epoch 100
  --eval-steps 20 --optimizer adamw --lr 1e-3 --lr-schedule cosine --lr-warmup 100 --lr-final 0.1
  --adam-b2 0.99 --weight-decay 0.1 --weight-decay-on matrices --grad-clip 1.0 --devices 8"
run() {  # out, then python -m train flags
  local out=$R/$1; shift
  [ -f "$out/metrics.json" ] || python -m train $NANOGPT --no-progress --out "$out" "$@"
}
DILOCO="outer_lr=0.7:outer_momentum=0.9"
STEP="outer_lr=1:outer_momentum=0.5"  # the outer step chosen on seed 0 ("step" below)
LOCO="outer_lr=1:outer_momentum=0:decay=0.95"  # SparseLoCo's rule
SPARSE="spardl:outer=10:density=0.03:wire=int4:$STEP"  # the sparse finalist, from "compress"
case "${1:-}" in
  step)
    run step_h30_600/s0 --epochs 6 --islands 2 --seed 0 --compare "dense,\
dense:outer=30:$DILOCO,dense:outer=30:outer_lr=0.4:outer_momentum=0.9,\
dense:outer=30:outer_lr=1:outer_momentum=0.5,dense:outer=30:outer_lr=1:outer_momentum=0"
    run h_600/s0 --epochs 6 --islands 2 --seed 0 --compare "dense:outer=10:$DILOCO,\
dense:outer=100:$DILOCO"
    ;;
  compress)
    run compress_600/s0 --epochs 6 --islands 2 --seed 0 --compare "\
dense:outer=100:$STEP,dense_bf16:outer=30:$STEP,dense_bf16:outer=50:$STEP,\
spardl:outer=30:density=0.1:wire=int8:$STEP,spardl:outer=30:density=0.03:wire=int4:$STEP,\
spardl:outer=10:density=0.03:wire=int4:$STEP,sparseloco:outer=30:density=0.03:$LOCO,\
topka:outer=30:density=0.03:$LOCO,dense:outer=30:fragments=3:$STEP,\
dense:outer=30:overlap=1:$STEP"
    run muon_600/s0 --epochs 6 --islands 2 --seed 0 --optimizer muon --lr 0.02 --adam-lr 1e-3 \
        --compare "dense,dense:outer=30:$STEP"
    ;;
  finals)  # seed 0 of the 600-step finalists is compress_600/s0
    for seed in 1 2; do
      run finals_600/s$seed --epochs 6 --islands 2 --seed $seed --compare "\
dense_bf16:outer=30:$STEP,dense_bf16:outer=50:$STEP,$SPARSE"
    done
    run sparse_600/s0 --epochs 6 --islands 2 --seed 0 --compare "\
spardl:outer=20:density=0.03:wire=int4:$STEP,spardl:outer=100:density=0.1:wire=int8:$STEP"
    run recipe_600/s0 --epochs 6 --islands 2 --seed 0 --compare spardl
    ;;
  long)
    for seed in 0 1 2; do
      run finals_2000/s$seed --epochs 20 --islands 2 --seed $seed --compare \
          "dense_bf16:outer=50:$STEP"
    done
    ;;
  count)
    for m in 4 8; do
      run count_600/m$m/s0 --epochs 6 --islands $m --seed 0 --compare "\
dense_bf16:outer=30:$STEP,dense_bf16:outer=50:$STEP"
    done
    for seed in 1 2; do
      run count_600/m4/s$seed --epochs 6 --islands 4 --seed $seed --compare \
          "dense_bf16:outer=50:$STEP"
    done
    ;;
  *) echo "usage: islands.sh step|compress|finals|count|long" >&2; exit 2 ;;
esac
