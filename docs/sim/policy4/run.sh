#!/usr/bin/env bash
# Round 5 of docs/SIMULATION.md: every Must-show sweep again on the corrected prefill cost (prompts
# prefilled in one step no longer attend to each other; until 2026-12-02 the sim engine charged a
# step's prompts as one long prompt). Three seeds, medians, as in docs/sim/policy/.
#   bash docs/sim/policy4/run.sh baselines   # INFaaS++ and faithful Llumnix: PREFIX.json
#   bash docs/sim/policy4/run.sh default     # shoal's default policy: PREFIX_default.json
#   python docs/sim/policy/summarize.py docs/sim/policy4
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/sim/policy4
case "${1:-}" in
  baselines) P=infaas,llumnix; TAG="" ;;
  default) P=shoal; TAG=_default ;;
  *) echo "usage: $0 baselines|default" >&2; exit 2 ;;
esac
S="--policies $P --seeds 0,1,2 --quiet"
H100="--profile llama-3.1-8b-h100 --instances 4"
sweep() { local name=$1; shift; shoal simulate sweep "$@" $S --out "$OUT/$name$TAG"; }
sweep azure_code_h100 --workload azure-code --rates 5,10,15,20 --requests 2900 $H100
sweep azure_conv_h100 --workload azure-conv --rates 40,60,80,100 --requests 3000 $H100
sweep chunked_azure_code_h100 --workload azure-code --rates 5,10,15,20 --requests 2900 $H100 --max-step-tokens 2048
sweep chunked_azure_conv_h100 --workload azure-conv --rates 40,60,80,100 --requests 3000 $H100 --max-step-tokens 2048
sweep azure_conv --workload azure-conv --rates 6,8,9,10,12 --requests 3000
sweep azure_code --workload azure-code --rates 2,4,6,8 --requests 2900
sweep mm --workload M-M --rates 6,9,10,11,13 --requests 3000
sweep sl --workload S-L --rates 4,5,6 --requests 3000
sweep priorities_mm --workload M-M --rates 11,12,13 --requests 3000 --high-share 0.1
sweep priorities_ss --workload S-S --rates 120,140,160 --requests 3000 --cv 4 --high-share 0.1
