#!/usr/bin/env bash
# Round 4 (2026-12-02): counting the running requests' expected decode growth before calling an
# instance free. `--dispatch blocks_ahead_growth` is shoal's policy with that growth (learned by each
# instance from the output lengths of the requests it finished, reported as
# LoadReport.expected_growth_blocks) taken off every instance's room, in dispatch and in the move of
# queued requests. Written as *_growth*; the INFaaS++ and round-3 default (`blocks_ahead`, *_shoal3*,
# priorities_mm*) runs they are compared with stand (deterministic), except S-L, which no table had:
# sl.json runs both here. summarize_growth.py prints the panel. Run one sweep at a time.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/sim/policy
S="--seeds 0,1,2 --quiet --no-plot"
G="--policies shoal --dispatch blocks_ahead_growth $S"
shoal simulate sweep --workload S-L --rates 5,6 --requests 3000 $G --out $OUT/sl_growth
shoal simulate sweep --workload S-L --rates 5,6 --requests 3000 --policies infaas,shoal $S --out $OUT/sl
shoal simulate sweep --workload M-M --rates 11,13 --requests 3000 $G --out $OUT/mm_growth
shoal simulate sweep --workload azure-conv --rates 40 --requests 3000 $G \
  --profile llama-3.1-8b-h100 --instances 4 --out $OUT/azure_conv_h100_growth
shoal simulate sweep --workload azure-conv --rates 9,10 --requests 3000 $G --out $OUT/azure_conv_growth
shoal simulate sweep --workload azure-code --rates 4,6 --requests 2900 $G --out $OUT/azure_code_growth
shoal simulate sweep --workload M-M --rates 12 --requests 3000 --high-share 0.1 $G --out $OUT/priorities_mm_growth
