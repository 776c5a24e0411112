#!/usr/bin/env bash
# Round 9 of docs/SIMULATION.md: paced migration copies (`--copy-share 0.1`) that hurry: the rest of
# a paced copy goes at full speed once its source is short of memory or another migration wants its
# slot (SimMigration.hurry; the agents' CopyPacer.hurry). The sweeps of round 7 (docs/sim/paced7),
# three seeds, medians; then S-L 5 and M-M 13 with 10% high priority over eight seeds, unpaced,
# round 7's pacing (not rerunnable: its code is gone; its 3-seed files are in paced7) and round 9's.
#   bash docs/sim/paced9/run.sh            # PREFIX_default.json and knee8/ here
#   python docs/sim/paced9/compare.py      # the round-9 tables
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/sim/paced9
S="--policies shoal --seeds 0,1,2 --quiet --no-plot --copy-share 0.1"
sweep() { local name=$1; shift; shoal simulate sweep "$@" $S --out "$OUT/${name}_default"; }
sweep azure_code --workload azure-code --rates 2,4,6,8 --requests 2900
sweep azure_conv --workload azure-conv --rates 6,8,9,10,12 --requests 3000
sweep mm --workload M-M --rates 6,9,10,11,13 --requests 3000
sweep sl --workload S-L --rates 4,5,6 --requests 3000
sweep priorities_mm --workload M-M --rates 11,12,13 --requests 3000 --high-share 0.1
sweep priorities_ss --workload S-S --rates 120,140,160 --requests 3000 --cv 4 --high-share 0.1
mkdir -p "$OUT/knee8"
E="--policies shoal --seeds 0,1,2,3,4,5,6,7 --quiet --no-plot"
for share in 0 0.1; do
  shoal simulate sweep --workload S-L --rates 5 --requests 3000 $E --copy-share $share --out "$OUT/knee8/sl_$share"
  shoal simulate sweep --workload M-M --rates 13 --requests 3000 --high-share 0.1 $E --copy-share $share \
    --out "$OUT/knee8/pm_$share"
done
