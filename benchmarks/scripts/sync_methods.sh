#!/usr/bin/env bash
# The CPU figures of benchmarks/results/sync_methods.md, on this project's 2-core machine with
# nothing else running (times are compute on simulated devices; the HLO traffic is exact):
#   1. every flat method side by side, n = 14.7M (VGG-16), P = 8 and 14, both SparDL wires;
#   2. SparDL at every team count d, P = 12 and 14;
#   3. the selection alone on one CPU device, n = 1M, 14.7M, 66M at 1 % and 0.1 %;
#   4. every method's whole sync on one CPU device, its 8 ranks batched by jax.vmap.
# Each writes its rows, where they ran and its tables (results.json / results.md, or
# selection.* / emulated.*) under benchmarks/results/sync_methods/; the page copies the
# tables, and the page tests re-render them from the rows.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=benchmarks/results/sync_methods
BENCH="python -m spardl_jax.tools.bench --n 14.7e6 --repeats 3 --max-memory-gb 16"
$BENCH --devices 8,14 --out $R/side_by_side
$BENCH --devices 12,14 --methods spardl --teams all --wire exact --out $R/teams
python -m spardl_jax.tools.bench --selection --n 1e6,14.7e6,66e6 --densities 0.01,0.001 \
  --repeats 3 --out $R/selection_cpu
python -m spardl_jax.tools.bench --emulate --devices 8 --n 14.7e6 --repeats 3 \
  --wire exact,compact --max-memory-gb 8 --out $R/emulated_cpu
