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
G="--policies shoal --dispatch blocks_ahead_growth $S"
shoal simulate sweep --workload S-L --rates 5,6 --requests 3000 $G --out $OUT/sl_growth
shoal simulate sweep --workload M-M --rates 11,13 --requests 3000 $G --out $OUT/mm_growth
shoal simulate sweep --workload azure-conv --rates 40 --requests 3000 $G \
  --profile llama-3.1-8b-h100 --instances 4 --out $OUT/azure_conv_h100_growth
shoal simulate sweep --workload azure-conv --rates 9,10 --requests 3000 $G --out $OUT/azure_conv_growth
shoal simulate sweep --workload azure-code --rates 4,6 --requests 2900 $G --out $OUT/azure_code_growth
shoal simulate sweep --workload M-M --rates 12 --requests 3000 --high-share 0.1 $G --out $OUT/priorities_mm_growth
# round 4 (today's `shoal`) at the panel's points and every other point of the Must-show list
# but S-S with priorities (the JSON files were written per rate group and merged, sorted by rate)
P="--policies shoal $S"
shoal simulate sweep --workload S-L --rates 5,6 --requests 3000 $P --out $OUT/sl_shoal4
shoal simulate sweep --workload M-M --rates 6,9,10,11,13 --requests 3000 $P --out $OUT/mm_shoal4
shoal simulate sweep --workload azure-conv --rates 6,8,9,10,12 --requests 3000 $P --out $OUT/azure_conv_shoal4
shoal simulate sweep --workload azure-code --rates 2,4,6,8 --requests 2900 $P --out $OUT/azure_code_shoal4
shoal simulate sweep --workload M-M --rates 11,12,13 --requests 3000 --high-share 0.1 $P \
  --out $OUT/priorities_mm_shoal4
shoal simulate sweep --workload azure-code --rates 5,10,15,20 --requests 2900 $P \
  --profile llama-3.1-8b-h100 --instances 4 --out $OUT/azure_code_h100_shoal4
shoal simulate sweep --workload azure-conv --rates 40,60,80,100 --requests 3000 $P \
  --profile llama-3.1-8b-h100 --instances 4 --out $OUT/azure_conv_h100_shoal4
# INFaaS++ on S-L (and, at commit c13ebed, the round-3 default):
# shoal simulate sweep --workload S-L --rates 5,6 --requests 3000 --policies infaas,shoal $S --out $OUT/sl
