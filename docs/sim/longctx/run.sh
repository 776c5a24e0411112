#!/usr/bin/env bash
# The long-context check of docs/SIMULATION.md ("Round 8"): 4 H100 instances, 3 seeds (trace windows).
set -euo pipefail
cd "$(dirname "$0")/../../.."
folder=$(mktemp -d)
trap 'rm -rf "$folder"' EXIT
trace="$folder/longctx.jsonl"
.venv/bin/python docs/sim/longctx/make_trace.py "$trace"
.venv/bin/shoal simulate sweep --workload "$trace" --rates 3,6,7,8,9,12 --seeds 0,1,2 --requests 2000 \
    --profile llama-3.1-8b-h100 --instances 4 --policies infaas,llumnix,shoal --out docs/sim/longctx/longctx --quiet
# round 8's rejected candidate on the same trace
.venv/bin/shoal simulate sweep --workload "$trace" --rates 3,6,7,8,9,12 --seeds 0,1,2 --requests 2000 \
    --profile llama-3.1-8b-h100 --instances 4 --policies shoal --dispatch prefill_ahead_saturated \
    --out docs/sim/longctx/longctx_saturated --no-plot --quiet
