#!/usr/bin/env bash
# Round 7 of docs/SIMULATION.md: migration copies paced (`--copy-share 0.1`, the agents'
# `--migration-copy-share`), unless the source is short of memory (MigrationConfig.for_source), on the
# Must-show sweeps where round 6's default migrated at all (the H100 sweeps made no migration: identical).
# Round 6's unpaced runs are docs/sim/policy5. Three seeds, medians.
#   bash docs/sim/paced7/run.sh            # PREFIX_default.json here
#   python docs/sim/paced7/compare.py      # the round-7 tables
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=docs/sim/paced7
S="--policies shoal --seeds 0,1,2 --quiet --no-plot --copy-share 0.1"
sweep() { local name=$1; shift; shoal simulate sweep "$@" $S --out "$OUT/${name}_default"; }
sweep azure_code --workload azure-code --rates 2,4,6,8 --requests 2900
sweep azure_conv --workload azure-conv --rates 6,8,9,10,12 --requests 3000
sweep mm --workload M-M --rates 6,9,10,11,13 --requests 3000
sweep sl --workload S-L --rates 4,5,6 --requests 3000
sweep priorities_mm --workload M-M --rates 11,12,13 --requests 3000 --high-share 0.1
sweep priorities_ss --workload S-S --rates 120,140,160 --requests 3000 --cv 4 --high-share 0.1
