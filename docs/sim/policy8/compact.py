"""Round 8's table (docs/SIMULATION.md): `prefill_ahead_saturated` beside round 6's default
(`prefill_ahead`, docs/sim/policy5), medians of 3 seeds. INFaaS++ is docs/sim/policy4's runs.

python docs/sim/policy8/compact.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from scheduler.sim.sweep import knee

HERE = Path(__file__).parent
BASELINES = HERE.parent / "policy4"
ROUND6 = HERE.parent / "policy5"
NAMES = {
    "azure_conv": "A10 azure-conv", "azure_code": "A10 azure-code", "mm": "M-M", "sl": "S-L (held out)",
    "priorities_mm": "M-M, 10% high", "azure_conv_h100": "H100 azure-conv",
    "azure_code_h100": "H100 azure-code", "chunked_azure_code_h100": "H100 azure-code, chunked",
    "chunked_azure_conv_h100": "H100 azure-conv, chunked", "priorities_ss": "S-S, 10% high",
}


def _shoal(path: Path) -> dict[float, dict[str, float]]:
    return {float(p["rate"]): p for p in json.loads(path.read_text()) if p["policy"] == "shoal"}


def _cell(i: dict[str, float], s: dict[str, float]) -> tuple[str, bool]:
    p99 = i["ttft_p99_s"] / s["ttft_p99_s"]
    mean = s["ttft_mean_s"] / i["ttft_mean_s"]
    tpot = s["tpot_p99_s"] / i["tpot_p99_s"]
    return f"{p99:.2f}x, {mean:.2f}, {tpot:.2f}", p99 >= 1 and mean <= 1.05 and tpot <= 1.05


def main() -> None:
    print("| sweep | knee (INFaaS++) | rate | round 8 (`prefill_ahead_saturated`): P99 TTFT INFaaS++/shoal, "
          "mean TTFT and P99 TPOT shoal/INFaaS++ | round 6 (`prefill_ahead`): the same "
          "| P99 TTFT s: INFaaS++ / round 6 / round 8 | same decisions |")
    print("|---|---|---|---|---|---|---|")
    for stem, name in NAMES.items():
        new = HERE / f"{stem}_default-median.json"
        if not new.exists():
            continue
        runs = json.loads((BASELINES / f"{stem}-median.json").read_text())
        base = [p for p in runs if p["policy"] != "shoal"]
        infaas = {float(p["rate"]): p for p in base if p["policy"] == "infaas"}
        old, cand = _shoal(ROUND6 / f"{stem}_default-median.json"), _shoal(new)
        k = knee(base, str(base[0]["workload"]), "infaas")
        for rate in sorted(cand):
            i = infaas[rate]
            c_text, c_ok = _cell(i, cand[rate])
            o_text, o_ok = _cell(i, old[rate])
            mark = "" if c_ok else "**"
            old_mark = "" if o_ok else "**"
            first = rate == min(cand)
            knee_text = f"{k:g}" if first and k is not None else ""
            seconds = " / ".join(f"{x['ttft_p99_s']:.2f}" for x in (i, old[rate], cand[rate]))
            keys = ("ttft_p99_s", "ttft_mean_s", "tpot_p99_s")
            same = "yes" if all(old[rate][key] == cand[rate][key] for key in keys) else ""
            print(f"| {name if first else ''} | {knee_text} | {rate:g}{' (knee)' if rate == k else ''} "
                  f"| {mark}{c_text}{mark} | {old_mark}{o_text}{old_mark} | {seconds} | {same} |")


if __name__ == "__main__":
    main()
