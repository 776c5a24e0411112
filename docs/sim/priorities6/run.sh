#!/usr/bin/env bash
# Round 6 of docs/SIMULATION.md: the local scheduler's priority rules, measured on M-M with 10% high
# priority (the round-5 harness: 3,000 requests, seeds 0,1,2, the default policy `shoal`). Every rule
# is off by default; none was adopted. Compare with docs/sim/policy4/priorities_mm{,_default}.json.
#   bash docs/sim/priorities6/run.sh            # the JSON here, then:
#   python docs/sim/priorities6/classes.py docs/sim/policy4/priorities_mm_default.json docs/sim/priorities6/*.json
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/sim/priorities6
S="--workload M-M --requests 3000 --high-share 0.1 --seeds 0,1,2 --quiet --no-plot"
sweep() { local name=$1; shift; shoal simulate sweep $S "$@" --out "$OUT/$name"; }
P="--policies shoal"
# the floor: light load, default and INFaaS++
sweep light --rates 4,6 --policies shoal,infaas
sweep preempt --rates 11,12,13 $P --priority-preemption
sweep alone --rates 11,12,13 $P --prompts-by-priority
sweep preempt_alone --rates 11,12,13 $P --priority-preemption --prompts-by-priority
sweep reserve32 --rates 11 $P --high-reserve-blocks 32
sweep chunked512 --rates 11 $P --max-step-tokens 512
# S-S (Gamma CV 4) with both rules, against docs/sim/policy4/priorities_ss_default.json
shoal simulate sweep --workload S-S --rates 120,140,160 --requests 3000 --cv 4 --high-share 0.1 \
  --seeds 0,1,2 --quiet --no-plot $P --priority-preemption --prompts-by-priority --out "$OUT/ss_preempt_alone"
# three more seeds of M-M with priorities, the default and --prompts-by-priority
S3="--workload M-M --requests 3000 --high-share 0.1 --seeds 3,4,5 --quiet --no-plot --rates 11,12,13"
shoal simulate sweep $S3 $P --out "$OUT/seeds345_default"
shoal simulate sweep $S3 $P --prompts-by-priority --out "$OUT/seeds345_alone"
S6="--workload M-M --requests 3000 --high-share 0.1 --seeds 6,7,8 --quiet --no-plot --rates 11,12,13"
shoal simulate sweep $S6 $P --out "$OUT/seeds678_default"
shoal simulate sweep $S6 $P --prompts-by-priority --out "$OUT/seeds678_alone"
# INFaaS++ on seeds 3-8 (seeds 0-2: docs/sim/policy4/priorities_mm.json)
shoal simulate sweep --workload M-M --requests 3000 --high-share 0.1 --seeds 3,4,5,6,7,8 --quiet --no-plot \
  --rates 11,12,13 --policies infaas --out "$OUT/seeds3to8_infaas"
