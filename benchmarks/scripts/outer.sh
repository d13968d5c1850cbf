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
python -m benchmarks.convergence --cases shakespeare_bert --variants diloco,diloco_spardl \
    --outer-every 30 --outer-momentum 0.9 --seeds 0 --out benchmarks/results/outer/bert_h30_m09
# SparseLoCo beside DiLoCo (benchmarks/results/outer.md, "SparseLoCo"): the main job, H = 30 on
# seeds 0-2, the decay and outer step on seed 0, H = 10 and 100 on seed 0.
R="outer_momentum=0:outer_lr=1"
loco() {  # out, then python -m train flags
  local out=benchmarks/results/outer/$1; shift
  [ -f "$out/metrics.json" ] || python -m train --epochs 30 --devices 8 --no-progress --out "$out" "$@"
}
for s in 0 1 2; do
  loco "sparseloco_h30/s$s" --seed "$s" --compare "dense,dense:outer=30,\
spardl:outer=30:density=0.03:wire=int4,sparseloco:density=0.03:outer=30:$R:decay=0.95,\
sparseloco:density=0.03:bits=4:outer=30:$R:decay=0.95,sparseloco:density=0.01:outer=30:$R:decay=0.95,\
spardl:density=0.03:wire=int4:outer=30:$R:decay=0.95,topka:density=0.03:outer=30:$R:decay=0.95"
done
loco sparseloco_h30_tune --seed 0 --compare "dense,sparseloco:density=0.03:outer=30:$R:decay=0.9,\
sparseloco:density=0.03:outer=30:$R:decay=0.99,sparseloco:density=0.03:outer=30:$R:decay=1,\
sparseloco:density=0.03:outer=30:outer_momentum=0:outer_lr=0.7:decay=0.95,\
sparseloco:density=0.03:outer=30:outer_momentum=0:outer_lr=1.5:decay=0.95,\
sparseloco:density=0.03:outer=30:decay=0.95,sparseloco:density=0.03:chunk=65536:outer=30:$R:decay=0.95"
# The SparDL outer sync's density and values at H = 30, and the outer step (DiLoCo's 0.7 / 0.9,
# plain averaging, 0.7 / 0.5, 0.4 / 0.9) at H = 10 and 30: seed 0 (outer.md's "In the outer
# loop at H = 30" and "How the defaults were chosen").
S="spardl:outer=30"
loco outer_wire_h30 --seed 0 --compare "dense,$S:density=0.01:wire=int4,$S:density=0.03:wire=int4,\
$S:density=0.03:wire=compact,$S:density=0.03:wire=int2,$S:density=0.1:wire=int2,\
$S:density=0.1:wire=int4,$S:density=0.03:wire=int8:outer_lr=0.4:outer_momentum=0.9,\
$S:density=0.03:wire=int4:outer_lr=1:outer_momentum=0"
loco outer_step --seed 0 --compare "dense$(for h in 10 30; do printf ',dense:outer=%s%s' $h \
  ":outer_lr=0.7:outer_momentum=0.9" $h ":outer_lr=1:outer_momentum=0" $h "" $h \
  ":outer_lr=0.4:outer_momentum=0.9"; done)"
for h in 10 100; do
  loco "sparseloco_h$h" --seed 0 --compare "dense,dense:outer=$h,spardl:outer=$h:density=0.03:wire=int4,\
sparseloco:density=0.03:outer=$h:$R:decay=0.95,spardl:density=0.03:wire=int4:outer=$h:$R:decay=0.95"
done
# The same beside DiLoCo on BERT (tiny) with AdamW inside, H = 30, seeds 0 and 1-2 (two runs;
# the BERT figures in outer.md ran at the case's former lr 1e-3, now 3e-3).
python -m benchmarks.convergence --cases shakespeare_bert --variants outer --outer-every 30 \
    --seeds 0 --out benchmarks/results/outer/bert_h30_loco/s0
python -m benchmarks.convergence --cases shakespeare_bert --variants outer --outer-every 30 \
    --seeds 1,2 --out benchmarks/results/outer/bert_h30_loco/s12
# A decoder-only language model with AdamW inside (three seeds), and the LSTM under SparseLoCo.
python -m benchmarks.convergence --cases shakespeare_gpt --outer-every 30 --seeds 0,1,2 \
    --variants diloco,diloco_bf16,diloco_spardl,sparseloco --on loss --target 0.98 \
    --out benchmarks/results/outer/gpt_h30
for t in 0.95 0.98; do
  python -m benchmarks.convergence --report benchmarks/results/outer/gpt_h30 --target $t \
      --out benchmarks/results/outer/gpt_h30/accuracy_$t
done
python -m benchmarks.convergence --cases shakespeare_lstm --variants diloco,sparseloco \
    --outer-every 30 --seeds 0 --out benchmarks/results/outer/lstm_h30_loco
# Time to accuracy of the outer loops at 100 Mbit/s, every byte paced (as root, nothing else
# running: the processes share the cores).
L="outer_momentum=0:outer_lr=1:decay=0.95"
M="dense,spardl,dense:outer=10,dense:outer=30,spardl:outer=30:density=0.03:wire=int4,\
sparseloco:density=0.03:outer=10:$L,sparseloco:density=0.03:outer=30:$L,topka:density=0.03:outer=30:$L"
for seed in 0 1; do
  python -m benchmarks.time_to_accuracy --processes 4 --rates 100mbit --epochs 12 --seeds $seed \
      --methods "$M" --out benchmarks/results/outer/tta_paced
done
python -m benchmarks.time_to_accuracy --report --processes 4 --rates 100mbit --seeds 0,1 \
    --methods "$M" --out benchmarks/results/outer/tta_paced
