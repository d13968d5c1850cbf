#!/usr/bin/env bash
# The projections of benchmarks/results/scale.md: time per iteration against P for three models and four
# links, from one H200's measured compute (benchmarks/results/scale/h200/): the train step at batch 32 per
# device, and each method's sync compute per device at P = 16 (n = 14.7M for VGG-16; ResNet-50
# scaled from it by n, BERT from the n = 66M figures; TopkDSA's from P = 8). gTopk (not
# emulable on one GPU) and PowerSGD (per matrix, not a flat vector) are left out.
set -eu
out=${1:-docs/scale}
p=2,4,8,16,32,64,128,256,512,1024
links=100mbit,10gbe,25gbe,ib100
python -m benchmarks.project --n 14.7e6 --step-ms 4.1 --p $p --links $links \
  --compute dense=0.06,dense_bf16=0.17,spardl=2.24,oktopk=1.11,topka=7.92,topkdsa=8.21 \
  --title VGG-16 --out "$out/vgg16"
python -m benchmarks.project --n 25.6e6 --step-ms 18.2 --p $p --links $links \
  --compute dense=0.11,dense_bf16=0.30,spardl=3.90,oktopk=1.93,topka=13.8,topkdsa=14.3 \
  --title ResNet-50 --out "$out/resnet50"
python -m benchmarks.project --n 133e6 --step-ms 47.9 --p $p --links $links \
  --compute dense=0.44,dense_bf16=1.05,spardl=21.1,oktopk=10.3,topka=88.9,topkdsa=92.3 \
  --title BERT-base --out "$out/bert"
