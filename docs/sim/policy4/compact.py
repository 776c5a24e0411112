"""Round 5's Must-show table (docs/SIMULATION.md): one row per sweep, medians of 3 seeds.

python docs/sim/policy4/compact.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from scheduler.sim.sweep import knee

HERE = Path(__file__).parent
NAMES = {
    "azure_conv": "A10 azure-conv", "azure_code": "A10 azure-code", "mm": "M-M", "sl": "S-L (held out)",
    "priorities_mm": "M-M, 10% high", "priorities_ss": "S-S, 10% high", "azure_conv_h100": "H100 azure-conv",
    "azure_code_h100": "H100 azure-code", "chunked_azure_conv_h100": "H100 azure-conv, chunked",
    "chunked_azure_code_h100": "H100 azure-code, chunked",
}


def main() -> None:
    print("| sweep | knee (INFaaS++) | rate: P99 TTFT INFaaS++/shoal, mean TTFT and P99 TPOT shoal/INFaaS++ "
          "| at the knee: P99 TTFT vs INFaaS++ / vs Llumnix |")
    print("|---|---|---|---|")
    for stem, name in NAMES.items():
        base, default = HERE / f"{stem}-median.json", HERE / f"{stem}_default-median.json"
        if not (base.exists() and default.exists()):
            continue
        points = [p for p in json.loads(base.read_text()) if p["policy"] != "shoal"]
        points += json.loads(default.read_text())
        by = {(float(p["rate"]), str(p["policy"])): p for p in points}
        rates = sorted({float(p["rate"]) for p in points})
        k = knee(points, str(points[0]["workload"]), "infaas")
        cells = []
        for rate in rates:
            i, s = by.get((rate, "infaas")), by.get((rate, "shoal"))
            if i is None or s is None:
                continue
            p99 = i["ttft_p99_s"] / s["ttft_p99_s"]
            mean = s["ttft_mean_s"] / i["ttft_mean_s"]
            tpot = s["tpot_p99_s"] / i["tpot_p99_s"]
            mark = "" if p99 >= 1 and mean <= 1.05 and tpot <= 1.05 else "**"
            cells.append(f"{mark}{rate:g}: {p99:.2f}x, {mean:.2f}, {tpot:.2f}{mark}")
        at_knee = ""
        if k is not None and (k, "shoal") in by:
            s = by[(k, "shoal")]
            at_knee = (f"{by[(k, 'infaas')]['ttft_p99_s'] / s['ttft_p99_s']:.2f}x / "
                       f"{by[(k, 'llumnix')]['ttft_p99_s'] / s['ttft_p99_s']:.2f}x")
        print(f"| {name} | {k if k is None else f'{k:g}'} | {'; '.join(cells)} | {at_knee} |")


if __name__ == "__main__":
    main()
