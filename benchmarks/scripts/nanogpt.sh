#!/usr/bin/env bash
# The nanoGPT case of benchmarks/results/adam.md (nanoGPT's baby GPT and CPU recipe, 8 simulated
# CPU devices): dense AdamW on three seeds, then each mechanism on seed 0, each variant in a
# folder of its own so that a long sequence keeps what finished; the table comes from --report,
# which joins a variant's seeds from several folders (SEEDS=1,2 OUT_SUFFIX=_s12 adds a
# finalist's other seeds beside its seed 0).
set -euo pipefail
cd "$(dirname "$0")/../.."
R=benchmarks/results/adam/nanogpt
RUN="python -m benchmarks.convergence --cases shakespeare_nanogpt --on loss --target 0.98"
[ -f $R/dense/results.json ] || $RUN --variants dense --seeds 0,1,2 --out $R/dense
for v in ${VARIANTS:-vectors recipe local_vectors vectors_2 vectors_4 vectors_5 powersgd \
             balanced balanced_5 vectors_int8_7 vectors_int8_7_refreshed vectors_int4_8 demo \
             demo_topka topka_vectors dense_bf16}; do
  out=$R/$v${OUT_SUFFIX:-}
  [ -f $out/results.json ] || $RUN --variants $v --no-dense --seeds ${SEEDS:-0} --out $out
done
# Every run folder under $1 (a variant's seeds may lie in several), comma-separated.
folders() { ls -d $1/*/ | grep -v /table/ | tr '\n' ',' | sed 's/,$//; s/\/,/,/g; s/\/$//'; }
$RUN --report "$(folders $R)" --out $R/table
# The sharded twin (data 4, model 2): dense (seeds 0 and 1) and the finalist on three seeds.
S=benchmarks/results/adam/nanogpt_sharded
SH="python -m benchmarks.convergence --cases shakespeare_nanogpt_sharded --on loss --target 0.98"
[ -f $S/dense/results.json ] || $SH --variants dense --seeds 0 --out $S/dense
[ -f $S/dense_s1/results.json ] || $SH --variants dense --seeds 1 --out $S/dense_s1
for seed in 0 1 2; do
  out=$S/vectors_int8_7$([ $seed = 0 ] || echo _s$seed)
  [ -f $out/results.json ] || $SH --variants vectors_int8_7 --no-dense --seeds $seed --out $out
done
$SH --report "$(folders $S)" --out $S/table
