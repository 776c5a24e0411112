#!/usr/bin/env bash
# shoal's runs again after its dispatch became "least blocks ahead, then freeness" (blocks_ahead
# ranks instances where the request would wait by the larger of the queued and pending prompt
# blocks and the memory deficit ahead of it; the former rule keeps the name queue_aware).
# INFaaS++ and Llumnix do not change: their runs in run.sh stand.
# The former default's runs (*_shoal60*) stay as "shoal-prev" in the tables.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/sim/policy
S="--policies shoal --seeds 0,1,2 --quiet"
chain_e() {
  shoal simulate sweep --workload M-M --rates 6,9,10,11,13 --requests 3000 $S --out $OUT/mm_shoal2
  shoal simulate sweep --workload azure-code --rates 2,4,6,8 --requests 2900 $S --out $OUT/azure_code_shoal2
  shoal simulate sweep --workload azure-code --rates 5,10,15,20 --requests 2900 $S \
    --profile llama-3.1-8b-h100 --instances 4 --out $OUT/azure_code_h100_shoal2
}
chain_f() {
  shoal simulate sweep --workload azure-conv --rates 6,8,9,10,12 --requests 3000 $S --out $OUT/azure_conv_shoal2
  shoal simulate sweep --workload azure-conv --rates 40,60,80,100 --requests 3000 $S \
    --profile llama-3.1-8b-h100 --instances 4 --out $OUT/azure_conv_h100_shoal2
  shoal simulate sweep --workload S-S --rates 120,140,160 --requests 3000 --cv 4 --high-share 0.1 \
    $S --out $OUT/priorities_ss_shoal2
  shoal simulate sweep --workload M-M --rates 11,12,13 --requests 3000 --high-share 0.1 \
    $S --out $OUT/priorities_mm_shoal2
}
chain_e > $OUT/chain_e.log 2>&1 &
chain_f > $OUT/chain_f.log 2>&1 &
wait
