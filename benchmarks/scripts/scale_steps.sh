#!/usr/bin/env bash
# The steps-to-accuracy runs of benchmarks/results/scale.md (simulated CPU devices in one process; time
# does not matter here) and the time-to-accuracy reports built from them. Each run writes
# benchmarks/results/scale/steps/<case>/<run>/metrics.json; `python -m benchmarks.scale` reads every run of a case.
set -euo pipefail
cd "$(dirname "$0")/../.."
all=dense,dense_bf16,spardl,topka,gtopk,oktopk,powersgd
run() {  # case, run name, then python -m train flags (--epochs 15 unless given again)
  local out=benchmarks/results/scale/steps/$1/$2
  shift 2
  complete "$out" || python -m train --epochs 15 --no-progress --out "$out" "$@"
}
complete() {  # a run folder whose metrics.json holds every variant it was asked for
  [ -f "$1/metrics.json" ] && python - "$1/metrics.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
sys.exit(0 if len(d["runs"]) == len(d["config"]["variants"]) else 1)
PY
}
for p in 8 16 32 64; do
  # Seed 0 ran in two parts (the first four methods in an earlier stop); a variant's run does
  # not depend on the others beside it.
  run mnist1d "s0_p$p" --devices $p --compare dense,spardl,topka,oktopk --seed 0
  run mnist1d "s0_extra_p$p" --devices $p --compare dense,dense_bf16,gtopk,powersgd --seed 0
  run mnist1d "s1_p$p" --devices $p --compare $all --seed 1
  run digits "s0_p$p" --model resnet20 --dataset digits --batch-size 128 --lr 0.05 \
    --devices $p --compare $all --seed 0
done
# Each sparse method at 0.5 %, 2 % and 5 % (1 % is in the runs above), seed 0.
dens=""
for m in spardl topka gtopk oktopk; do for d in 0.005 0.02 0.05; do dens="$dens,$m:density=$d"; done; done
for p in 16 64; do
  run mnist1d "density_s0_p$p" --devices $p --compare "dense$dens" --seed 0
done
# The density rule (benchmarks/results/scale.md, "The density rule"): the main job with a test
# every 8 steps (58 of them), and digits; dense, bf16 dense, SparDL at 1 % and with the rule,
# TopkA, Ok-Topk and PowerSGD, seeds 0-2. Digits' seed 0 ran the rule alone beside the runs above.
rule=dense,dense_bf16,spardl,spardl:density=auto,topka,oktopk,powersgd
for seed in 0 1 2; do
  for p in 8 16 32 64; do
    run mnist1d_e8 "s${seed}_p$p" --devices $p --seed $seed --steps-per-epoch 8 --epochs 58 \
      --compare $rule
  done
done
for p in 8 16 32 64; do
  run digits "rule_s0_p$p" --model resnet20 --dataset digits --batch-size 128 --lr 0.05 \
    --devices $p --seed 0 --compare spardl:density=auto
  for seed in 1 2; do
    run digits "s${seed}_p$p" --model resnet20 --dataset digits --batch-size 128 --lr 0.05 \
      --devices $p --seed $seed --compare $rule
  done
done
# Denser than the rule at P = 64, where the rule misses (seed 0 also with DGC's ramp to 5 %).
for seed in 0 1 2; do
  extra=""; [ $seed = 0 ] && extra="spardl:density=0.05:ramp=32,spardl:density=0.05:ramp=64,"
  run dense_p64 "s$seed" --devices 64 --seed $seed --steps-per-epoch 8 --epochs 58 \
    --compare "${extra}spardl:density=0.065"
done
for target in 0.95 0.98; do
  for case in mnist1d_e8 digits; do
    python -m benchmarks.scale --runs benchmarks/results/scale/steps/$case --target $target
  done
done
python -m benchmarks.scale --runs benchmarks/results/scale/steps/mnist1d_e8 \
  --projection benchmarks/results/scale/vgg16 --model vgg16 --target 0.98 \
  --out benchmarks/results/scale/tta/mnist1d_e8_vgg16
for model in vgg16 resnet50 bert; do
  python -m benchmarks.scale --runs benchmarks/results/scale/steps/mnist1d --projection "benchmarks/results/scale/$model" \
    --model "$model" --target 0.98 --out "benchmarks/results/scale/tta/mnist1d_$model"
done
python -m benchmarks.scale --runs benchmarks/results/scale/steps/digits --projection benchmarks/results/scale/resnet50 \
  --model resnet50 --target 0.98 --out benchmarks/results/scale/tta/digits_resnet50
