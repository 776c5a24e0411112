#!/usr/bin/env bash
# The default-policy sweeps of docs/SIMULATION.md ("The default policy"): INFaaS++, faithful
# Llumnix and shoal, three seeds each (synthetic: new draws; traces: the next window of rows),
# medians in PREFIX-median.json, knees printed. Three chains, run side by side.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/sim/policy
P=infaas,llumnix,shoal
S="--seeds 0,1,2 --quiet"
chain_a() {
  shoal simulate sweep --workload azure-conv --rates 6,8,9,10,12 --requests 3000 --policies $P $S --out $OUT/azure_conv
}
chain_mm() {
  shoal simulate sweep --workload M-M --rates 6,9,10,11,13 --requests 3000 --policies $P $S --out $OUT/mm
}
chain_b() {
  shoal simulate sweep --workload azure-code --rates 2,4,6,8 --requests 2900 --policies $P $S --out $OUT/azure_code
  shoal simulate sweep --workload azure-code --rates 5,10,15,20 --requests 2900 --policies $P $S \
    --profile llama-3.1-8b-h100 --instances 4 --out $OUT/azure_code_h100
  shoal simulate sweep --workload azure-conv --rates 40,60,80,100 --requests 3000 --policies $P $S \
    --profile llama-3.1-8b-h100 --instances 4 --out $OUT/azure_conv_h100
  shoal simulate sweep --workload S-S --rates 120,140,160 --requests 3000 --cv 4 --high-share 0.1 \
    --policies $P $S --out $OUT/priorities_ss
}
chain_a > $OUT/chain_a.log 2>&1 &
chain_b > $OUT/chain_b.log 2>&1 &
chain_mm > $OUT/chain_mm.log 2>&1 &
wait
