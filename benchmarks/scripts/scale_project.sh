#!/usr/bin/env bash
# The projections of benchmarks/results/scale.md: time per iteration against P for three models and four
# links, from one H200's measured compute (benchmarks/results/scale/h200/, 2026-11-26, before the radix
# selection): the train step at batch 32 per device, and each method's sync compute per device
# as emulated at P = 8 (emulate8.json) and P = 16 (emulate16.json); every other P takes the
# nearest measured P's figure below it, marked extrapolated. VGG-16's n = 14.7M; ResNet-50's
# figures scaled from it by n, BERT's from the n = 66M ones (TopkDSA's at P = 8 only). gTopk (not
# emulable on one GPU) and PowerSGD (per matrix, not a flat vector) have no GPU figure: their
# compute is estimated (~ in the tables): PowerSGD at 1.87x SparDL's P = 8 figure (this CPU's
# ratio on VGG-16's matrices, benchmarks/vgg16_compute.py), independent of P; gTopk at TopkA's
# (one top-k over all n entries a sync, as TopkA's).
set -eu
out=${1:-benchmarks/results/scale}
p=2,4,8,16,32,64,128,256,512,1024
links=100mbit,10gbe,25gbe,ib100
python -m benchmarks.project --n 14.7e6 --step-ms 4.1 --p $p --links $links \
  --compute dense=8:0.074/16:0.063,dense_bf16=8:0.154/16:0.171,spardl=8:5.10/16:2.24,oktopk=8:1.22/16:1.11,topka=8:7.95/16:7.92,topkdsa=8:8.28/16:8.21 \
  --estimated powersgd=9.54,gtopk=8:7.95/16:7.92 \
  --title VGG-16 --out "$out/vgg16"
python -m benchmarks.project --n 25.6e6 --step-ms 18.2 --p $p --links $links \
  --compute dense=8:0.13/16:0.11,dense_bf16=8:0.27/16:0.30,spardl=8:8.88/16:3.90,oktopk=8:2.12/16:1.93,topka=8:13.8/16:13.8,topkdsa=8:14.4/16:14.3 \
  --estimated powersgd=16.6,gtopk=8:13.8/16:13.8 \
  --title ResNet-50 --out "$out/resnet50"
python -m benchmarks.project --n 133e6 --step-ms 47.9 --p $p --links $links \
  --compute dense=8:0.48/16:0.44,dense_bf16=8:1.05/16:1.05,spardl=8:51.2/16:21.1,oktopk=8:10.6/16:10.3,topka=8:88.4/16:88.9,topkdsa=8:92.2 \
  --estimated powersgd=95.7,gtopk=8:88.4/16:88.9 \
  --title BERT-base --out "$out/bert"
