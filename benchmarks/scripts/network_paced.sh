#!/usr/bin/env bash
# The emulated-network figures of benchmarks/results/network.md with every byte paced (netbench's
# token bucket holds one timer tick of the rate, `netbench.tbf_burst`), as root: one sync of
# every method at 4 and 8 processes (unshaped, 1 Gbit/s, 100 Mbit/s) checked against the
# projection, then time to accuracy at 8 processes over three seeds. Nothing else may run on
# the machine meanwhile: the processes share its cores.
set -eu
cd "$(dirname "$0")/../.."
out=${1:-benchmarks/results/network}
# unshaped twice: the rate measured first runs slow (results/scale.md), the second is kept.
# Eight processes at n = 4M, so that eight fit on two cores, with more repeats for the noise.
sync() {  # processes, n, repeats
  python -m benchmarks.netbench --processes $1 --rates unshaped,unshaped,1gbit,100mbit --n $2 \
    --repeats $3 --out "$out/sync_p$1" | grep -v "\[Gloo\]" | tee "$out/sync_p$1.md"
  python -m benchmarks.project --validate "$out/sync_p$1/results.json" --processes $1 --n $2 \
    | tee "$out/sync_p${1}_validation.md"
}
sync 4 14.7e6 3
sync 8 4e6 7
methods=dense,dense_bf16,spardl,spardl:density=auto,topka,gtopk,oktopk,powersgd:rank=4
python -m benchmarks.time_to_accuracy --processes 8 --seeds 0,1,2 \
  --rates unshaped,1gbit,100mbit --methods $methods --out "$out/tta_p8"
for seed in 0 1 2; do
  python -m benchmarks.project --validate "$out/tta_p8/results.json" --processes 8 \
    --seed $seed | tee "$out/tta_p8/validation_seed$seed.md"
done
