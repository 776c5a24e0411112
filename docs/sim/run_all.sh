#!/usr/bin/env bash
# Every simulation behind docs/SIMULATION.md, one after another (single-threaded runs).
# Usage: bash docs/sim/run_all.sh   (from the repository root, with the venv active)
# Traces: "Azure LLM inference trace 2023", Microsoft Azure Public Dataset (CC-BY 4.0).
set -euo pipefail
out=docs/sim
q=--quiet
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }

stamp "speed: 10,000 Azure-conv requests on 16 instances"
shoal simulate --trace azure-conv --requests 10000 --rate 8 --policy shoal --json $out/speed.json $q

stamp "real trace: Azure conversation, rate sweep"
shoal simulate sweep --workload azure-conv --rates 6,7,8,9,10 --policies rr,infaas,llumnix-base,llumnix,shoal \
  --requests 10000 --out $out/azure_conv $q

stamp "real trace: Azure code (long prompts), rate sweep"
shoal simulate sweep --workload azure-code --rates 2,3,4,5,6 --policies rr,infaas,llumnix,shoal \
  --requests 5000 --out $out/azure_code $q

stamp "synthetic M-M, rate sweep"
shoal simulate sweep --workload M-M --rates 6,8,10,12,14 --policies rr,infaas,llumnix,shoal \
  --requests 5000 --seed 1 --out $out/mm $q

stamp "synthetic L-S, rate sweep"
shoal simulate sweep --workload L-S --rates 12,16,20,24,28 --policies rr,infaas,llumnix,shoal \
  --requests 5000 --seed 1 --out $out/ls $q

stamp "fragmentation over time: M-M at 10 req/s"
shoal simulate --mix M-M --rate 10 --requests 5000 --seed 1 --policy infaas,llumnix,shoal \
  --json $out/mm10.json --plots $out/mm10 $q

stamp "priorities: S-S, 10% high priority, Gamma arrivals"
for cv in 1 2 4 8; do
  shoal simulate sweep --workload S-S --rates 120 --cv $cv --high-share 0.1 --seed 1 \
    --policies llumnix-base,llumnix,shoal --requests 5000 --no-plot --out $out/prio_cv$cv $q
done

stamp "auto-scaling: L-L at 2 req/s, band [x, x+50], 20 s cold start"
for x in 2 5 10 20 40; do
  shoal simulate --mix L-L --rate 2 --requests 3000 --seed 1 --policy infaas,shoal --autoscale \
    --instances 8 --max-instances 16 --scale-band $x,$((x + 50)) --json $out/autoscale_x$x.json $q
done
shoal simulate --mix L-L --rate 2 --requests 3000 --seed 1 --policy infaas,shoal --autoscale \
  --instances 8 --max-instances 16 --scale-band 10,60 --plots $out/autoscale $q > /dev/null
stamp "done"
