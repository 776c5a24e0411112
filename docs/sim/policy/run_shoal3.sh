#!/usr/bin/env bash
# The default policy with moving queued requests (round 3, 2026-12-02): blocks_ahead dispatch,
# shoal's migration pairing and the move of queued requests after 0.5 s (SHOAL_REQUEUE_AFTER_S:
# a queue whose head waited 0.5 s gives its newest never-run request to an instance where it
# starts at once), which `--policy shoal` now runs by default. Written as *_shoal3*;
# summarize.py shows them as "shoal". INFaaS++ and Llumnix runs in run.sh (run_shoal60.sh for
# M-M with priorities, run_chunked.sh for the chunked H100 sweeps) stand: both are deterministic.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/sim/policy
S="--policies shoal --seeds 0,1,2 --quiet"
chain_i() {
  shoal simulate sweep --workload M-M --rates 6,9,10,11,13 --requests 3000 $S --out $OUT/mm_shoal3
  shoal simulate sweep --workload azure-code --rates 2,4,6,8 --requests 2900 $S --out $OUT/azure_code_shoal3
  shoal simulate sweep --workload azure-code --rates 5,10,15,20 --requests 2900 $S \
    --profile llama-3.1-8b-h100 --instances 4 --out $OUT/azure_code_h100_shoal3
  shoal simulate sweep --workload azure-conv --rates 40,60,80,100 --requests 3000 $S --max-step-tokens 2048 \
    --profile llama-3.1-8b-h100 --instances 4 --out $OUT/chunked_azure_conv_h100_shoal3
}
chain_j() {
  shoal simulate sweep --workload azure-conv --rates 6,8,9,10,12 --requests 3000 $S --out $OUT/azure_conv_shoal3
  shoal simulate sweep --workload azure-conv --rates 40,60,80,100 --requests 3000 $S \
    --profile llama-3.1-8b-h100 --instances 4 --out $OUT/azure_conv_h100_shoal3
  shoal simulate sweep --workload S-S --rates 120,140,160 --requests 3000 --cv 4 --high-share 0.1 \
    $S --out $OUT/priorities_ss_shoal3
  shoal simulate sweep --workload M-M --rates 11,12,13 --requests 3000 --high-share 0.1 \
    $S --out $OUT/priorities_mm_shoal3
  shoal simulate sweep --workload azure-code --rates 5,10,15,20 --requests 2900 $S --max-step-tokens 2048 \
    --profile llama-3.1-8b-h100 --instances 4 --out $OUT/chunked_azure_code_h100_shoal3
}
chain_i > $OUT/chain_i.log 2>&1 &
chain_j > $OUT/chain_j.log 2>&1 &
wait
