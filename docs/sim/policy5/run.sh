#!/usr/bin/env bash
# Round 6 of docs/SIMULATION.md: dispatch that counts the prompts admitted but not yet prefilled
# (`prefill_ahead`, LoadReport.prefill_blocks) on the Must-show panel; INFaaS++, Llumnix and the round-5
# default (`blocks_ahead`) are docs/sim/policy4's runs (the simulator is deterministic). Three seeds, medians.
#   bash docs/sim/policy5/run.sh            # shoal (prefill_ahead dispatch): PREFIX_default.json
#   python docs/sim/policy5/compact.py      # the round-6 table (round 5's default beside it)
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/sim/policy5
S="--policies shoal --seeds 0,1,2 --quiet"  # shoal = prefill_ahead dispatch since round 6
H100="--profile llama-3.1-8b-h100 --instances 4"
sweep() { local name=$1; shift; shoal simulate sweep "$@" $S --out "$OUT/${name}_default"; }
sweep azure_code_h100 --workload azure-code --rates 5,10,15,20 --requests 2900 $H100
sweep azure_code --workload azure-code --rates 2,4,6,8 --requests 2900
sweep azure_conv --workload azure-conv --rates 6,8,9,10,12 --requests 3000
sweep azure_conv_h100 --workload azure-conv --rates 40,60,80,100 --requests 3000 $H100
sweep mm --workload M-M --rates 6,9,10,11,13 --requests 3000
sweep sl --workload S-L --rates 4,5,6 --requests 3000
sweep priorities_mm --workload M-M --rates 11,12,13 --requests 3000 --high-share 0.1
sweep chunked_azure_code_h100 --workload azure-code --rates 5,10,15,20 --requests 2900 $H100 --max-step-tokens 2048
sweep chunked_azure_conv_h100 --workload azure-conv --rates 40,60,80,100 --requests 3000 $H100 --max-step-tokens 2048
sweep priorities_ss --workload S-S --rates 120,140,160 --requests 3000 --cv 4 --high-share 0.1
