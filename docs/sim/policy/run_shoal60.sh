#!/usr/bin/env bash
# shoal's runs again after its destination threshold went from 30 to 60 (INFaaS++ and Llumnix do
# not change: their runs in run.sh stand). The 30-threshold runs stay in PREFIX.json as an ablation.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/sim/policy
S="--policies shoal --seeds 0,1,2 --quiet"
chain_c() {
  shoal simulate sweep --workload azure-conv --rates 6,8,9,10,12 --requests 3000 $S --out $OUT/azure_conv_shoal60
  shoal simulate sweep --workload azure-code --rates 2,4,6,8 --requests 2900 $S --out $OUT/azure_code_shoal60
  shoal simulate sweep --workload azure-code --rates 5,10,15,20 --requests 2900 $S \
    --profile llama-3.1-8b-h100 --instances 4 --out $OUT/azure_code_h100_shoal60
}
chain_d() {
  shoal simulate sweep --workload M-M --rates 6,9,10,11,13 --requests 3000 $S --out $OUT/mm_shoal60
  shoal simulate sweep --workload azure-conv --rates 40,60,80,100 --requests 3000 $S \
    --profile llama-3.1-8b-h100 --instances 4 --out $OUT/azure_conv_h100_shoal60
  shoal simulate sweep --workload S-S --rates 120,140,160 --requests 3000 --cv 4 --high-share 0.1 \
    $S --out $OUT/priorities_ss_shoal60
}
chain_c > $OUT/chain_c.log 2>&1 &
chain_d > $OUT/chain_d.log 2>&1 &
wait
# After both: priorities where queues build (M-M around its knee), all three policies.
shoal simulate sweep --workload M-M --rates 11,12,13 --requests 3000 --high-share 0.1 \
  --policies infaas,llumnix,shoal --seeds 0,1,2 --quiet --out $OUT/priorities_mm > $OUT/chain_prio_mm.log 2>&1
