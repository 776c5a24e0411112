#!/usr/bin/env bash
# The H100 sweeps again with a per-step token budget of 2,048 (chunked prefill, as vLLM V1 and
# the torch engine run it): does the conclusion on the prefill-bound profile change?
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/sim/policy
S="--policies infaas,llumnix,shoal --seeds 0,1,2 --quiet --profile llama-3.1-8b-h100 --instances 4 --max-step-tokens 2048"
shoal simulate sweep --workload azure-code --rates 5,10,15,20 --requests 2900 $S \
  --out $OUT/chunked_azure_code_h100 > $OUT/chain_chunked_a.log 2>&1 &
shoal simulate sweep --workload azure-conv --rates 40,60,80,100 --requests 3000 $S \
  --out $OUT/chunked_azure_conv_h100 > $OUT/chain_chunked_b.log 2>&1 &
wait
