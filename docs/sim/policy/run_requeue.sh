#!/usr/bin/env bash
# shoal with the simulator-only move of queued requests (--requeue-after-s 1: a queue whose head
# waited 1 s gives its newest never-run request to an instance where it starts at once). Not the
# default: the live agents do not do it. INFaaS++ and Llumnix runs in run.sh stand.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/sim/policy
S="--policies shoal --seeds 0,1,2 --quiet --requeue-after-s 1"
chain_g() {
  shoal simulate sweep --workload M-M --rates 6,9,10,11,13 --requests 3000 $S --out $OUT/mm_requeue
  shoal simulate sweep --workload azure-code --rates 2,4,6,8 --requests 2900 $S --out $OUT/azure_code_requeue
  shoal simulate sweep --workload azure-code --rates 5,10,15,20 --requests 2900 $S \
    --profile llama-3.1-8b-h100 --instances 4 --out $OUT/azure_code_h100_requeue
}
chain_h() {
  shoal simulate sweep --workload azure-conv --rates 6,8,9,10,12 --requests 3000 $S --out $OUT/azure_conv_requeue
  shoal simulate sweep --workload azure-conv --rates 40,60,80,100 --requests 3000 $S \
    --profile llama-3.1-8b-h100 --instances 4 --out $OUT/azure_conv_h100_requeue
  shoal simulate sweep --workload S-S --rates 120,140,160 --requests 3000 --cv 4 --high-share 0.1 \
    $S --out $OUT/priorities_ss_requeue
  shoal simulate sweep --workload M-M --rates 11,12,13 --requests 3000 --high-share 0.1 \
    $S --out $OUT/priorities_mm_requeue
}
chain_g > $OUT/chain_g.log 2>&1 &
chain_h > $OUT/chain_h.log 2>&1 &
wait
