#!/usr/bin/env bash
# Round 4 (2026-12-02): counting the running requests' expected decode growth before calling an
# instance free. Each instance learns an output length from the requests it finished and reports
# LoadReport.expected_growth_blocks (scheduler/policy/growth.py). Two uses were measured:
#  * `shoal` (default, written as *_shoal4*): the move of queued requests goes only where the
#    request starts at once *and stays* (room after that growth); dispatch unchanged. Adopted.
#  * `--dispatch blocks_ahead_growth` (*_growth*): the growth also taken off every instance's room in
#    dispatch. Not adopted (kept under its name).
# INFaaS++ and the round-3 default (*_shoal3*, priorities_mm*) come from run.sh / run_shoal3.sh /
# run_shoal60.sh (deterministic). S-L had no table: sl.json holds INFaaS++ and the round-3 default,
# run at commit c13ebed (before round 4 changed `shoal`'s move; today the second line's `shoal`
# runs are the *_shoal4* ones). summarize_growth.py prints the panel and writes growth_panel.json.
# Run one sweep at a time (2 shared cores).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/sim/policy
S="--seeds 0,1,2 --quiet --no-plot"
for variant in growth shoal4; do
  if [ $variant = growth ]; then P="--policies shoal --dispatch blocks_ahead_growth $S"; else P="--policies shoal $S"; fi
  shoal simulate sweep --workload S-L --rates 5,6 --requests 3000 $P --out $OUT/sl_$variant
  shoal simulate sweep --workload M-M --rates 11,13 --requests 3000 $P --out $OUT/mm_$variant
  shoal simulate sweep --workload azure-conv --rates 40 --requests 3000 $P \
    --profile llama-3.1-8b-h100 --instances 4 --out $OUT/azure_conv_h100_$variant
  shoal simulate sweep --workload azure-conv --rates 9,10 --requests 3000 $P --out $OUT/azure_conv_$variant
  shoal simulate sweep --workload azure-code --rates 4,6 --requests 2900 $P --out $OUT/azure_code_$variant
  shoal simulate sweep --workload M-M --rates 12 --requests 3000 --high-share 0.1 $P \
    --out $OUT/priorities_mm_$variant
done
# INFaaS++ on S-L (and, at commit c13ebed, the round-3 default):
# shoal simulate sweep --workload S-L --rates 5,6 --requests 3000 --policies infaas,shoal $S --out $OUT/sl
