#!/usr/bin/env bash
# The Adam(W) measurements of benchmarks/results/adam.md (8 simulated CPU devices, one process;
# the sharded cases on a (data 4, model 2) mesh). Targets: dense's final test loss + 2 %.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=benchmarks/results/adam
C=shakespeare_gpt,shakespeare_gpt_sharded,teacher_dotrelu,shakespeare_bert
GPT="--model gpt --model-size tiny --dataset shakespeare --epochs 10 --batch-size 64 --seq-len 64 \
--steps-per-epoch 200 --eval-steps 30 --optimizer adamw --lr-schedule cosine --log-every 200"
# Dense AdamW's learning rate, each case (seed 0): the cases' lr is the best.
python -m train $GPT --lr 1e-2 --compare dense:lr=1e-3,dense:lr=3e-3,dense:lr=1e-2,dense:lr=3e-2 \
    --out $R/lr_gpt
python -m train --model dotrelu --dataset teacher --mesh data=4,model=2 --optimizer adamw \
    --lr-schedule cosine --epochs 6 --batch-size 64 --steps-per-epoch 50 \
    --compare dense:lr=3e-4,dense:lr=1e-3,dense:lr=3e-3 --out $R/lr_teacher
python -m train --model bert --model-size tiny --dataset shakespeare --epochs 10 --batch-size 64 \
    --seq-len 64 --steps-per-epoch 200 --eval-steps 30 --optimizer adamw --log-every 200 \
    --compare dense:lr=3e-4,dense:lr=1e-3,dense:lr=3e-3,dense:lr=1e-2,dense:lr=3e-3:freeze=200 \
    --out $R/lr_bert
# Each piece alone (seed 0).
for c in shakespeare_gpt teacher_dotrelu shakespeare_bert; do
  python -m benchmarks.convergence --cases $c --variants adam --seeds 0 --on loss --target 0.98 \
      --out $R/ablation_${c#*_}_s0
done
# The synced moment's learning rate, density, warm-up and second moment (seed 0).
python -m train $GPT --lr 1e-2 --recipe paper --compare "spardl:warmup=50:synced=momentum:lr=3e-2,\
spardl:warmup=50:synced=momentum:lr=3e-3,spardl:warmup=50:synced=momentum:density=0.02,\
spardl:warmup=200:synced=momentum,spardl:warmup=50:synced=preconditioned,\
spardl:warmup=50:synced=preconditioned:density=0.02,spardl:warmup=50:synced=momentum:second_moment=sent,\
spardl:warmup=50:synced=momentum:second_moment=sent:density=0.02" --out $R/tune_gpt_s0
# The recipe on three seeds, and the competitors with the same recipe (seed 0).
python -m benchmarks.convergence --cases $C --variants dense,recipe,recipe_2 --seeds 0,1,2 \
    --on loss --target 0.98 --out $R/recipe
# (PowerSGD cannot run on the sharded GPT: some of its parameters are replicated over 'model'.)
for c in shakespeare_gpt teacher_dotrelu shakespeare_bert; do
  python -m benchmarks.convergence --cases $c --variants dense,topka,powersgd,dense_bf16 \
      --seeds 0 --on loss --target 0.98 --out $R/competitors/$c
done
