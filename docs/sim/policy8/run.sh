#!/usr/bin/env bash
# Round 8 of docs/SIMULATION.md: `prefill_ahead_saturated` (prefill_ahead, but a request that would
# wait for memory on every instance goes to INFaaS++'s least memory load) on round 6's Must-show panel.
# INFaaS++ and Llumnix are docs/sim/policy4's runs, round 6's default docs/sim/policy5's (the simulator
# is deterministic). Three seeds, medians. Two sweeps at a time.
#   bash docs/sim/policy8/run.sh
#   python docs/sim/policy8/compact.py
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/sim/policy8
S="--policies shoal --dispatch prefill_ahead_saturated --seeds 0,1,2 --quiet"
H100="--profile llama-3.1-8b-h100 --instances 4"
sweep() { local name=$1; shift; .venv/bin/shoal simulate sweep "$@" $S --out "$OUT/${name}_default" > /dev/null; }
{
    sweep azure_conv --workload azure-conv --rates 6,8,9,10,12 --requests 3000
    sweep mm --workload M-M --rates 6,9,10,11,13 --requests 3000
    sweep priorities_mm --workload M-M --rates 11,12,13 --requests 3000 --high-share 0.1
    sweep azure_code_h100 --workload azure-code --rates 5,10,15,20 --requests 2900 $H100
    sweep chunked_azure_conv_h100 --workload azure-conv --rates 40,60,80,100 --requests 3000 $H100 --max-step-tokens 2048
} &
{
    sweep azure_code --workload azure-code --rates 2,4,6,8 --requests 2900
    sweep sl --workload S-L --rates 4,5,6 --requests 3000
    sweep priorities_ss --workload S-S --rates 120,140,160 --requests 3000 --cv 4 --high-share 0.1
    sweep azure_conv_h100 --workload azure-conv --rates 40,60,80,100 --requests 3000 $H100
    sweep chunked_azure_code_h100 --workload azure-code --rates 5,10,15,20 --requests 2900 $H100 --max-step-tokens 2048
} &
wait
