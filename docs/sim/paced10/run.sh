#!/usr/bin/env bash
# Round 10 of docs/SIMULATION.md: the three 3-seed outliers of round 9 (M-M 13, S-L 6, M-M 12 with
# 10% high priority) over eight seeds, unpaced (the default) and paced at 0.1 with round 10's
# catch-up stage (a paced stage's new blocks go in a small unpaced stage before the suspend).
#   bash docs/sim/paced10/run.sh          # the JSON files here
#   python docs/sim/paced10/compare.py    # the round-10 table
# Round 9's code (no catch-up stage) was run from a checkout of 9116ffd with this script copied in:
#   cd CHECKOUT && PYTHONPATH=$PWD OUT=$REPO/docs/sim/paced10 bash docs/sim/paced10/run.sh paced 0.1 _round9
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-docs/sim/paced10}
E="--policies shoal --seeds 0,1,2,3,4,5,6,7 --quiet --no-plot"
run() {  # run NAME SHARE [SUFFIX]
  local name=$1 share=$2 suffix=${3:-}
  shoal simulate sweep --workload M-M --rates 13 --requests 3000 $E --copy-share "$share" --out "$OUT/mm13_$name$suffix"
  shoal simulate sweep --workload S-L --rates 6 --requests 3000 $E --copy-share "$share" --out "$OUT/sl6_$name$suffix"
  shoal simulate sweep --workload M-M --rates 12 --requests 3000 --high-share 0.1 $E --copy-share "$share" \
    --out "$OUT/pm12_$name$suffix"
}
if [ $# -gt 0 ]; then run "$@"; else run unpaced 0; run paced 0.1; fi
