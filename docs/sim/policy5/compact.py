"""Round 6's table (docs/SIMULATION.md): `prefill_ahead` dispatch beside round 5's default, medians of
3 seeds. INFaaS++ and Llumnix are docs/sim/policy4's runs, round 5's default its `*_default` runs.

python docs/sim/policy5/compact.py
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from scheduler.sim.sweep import knee

HERE = Path(__file__).parent
ROUND5 = HERE.parent / "policy4"
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


def rows(candidates: Path, previous: Path) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """Per sweep point: the first table cells (sweep, knee, rate, both policies' cells, the P99s),
    and the previous and candidate medians; INFaaS++ is ROUND5's (docs/sim/policy4) runs."""
    for stem, name in NAMES.items():
        new = candidates / f"{stem}_default-median.json"
        if not new.exists():
            continue
        base = [p for p in json.loads((ROUND5 / f"{stem}-median.json").read_text()) if p["policy"] != "shoal"]
        infaas = {float(p["rate"]): p for p in base if p["policy"] == "infaas"}
        old, cand = _shoal(previous / f"{stem}_default-median.json"), _shoal(new)
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
            cells = (f"| {name if first else ''} | {knee_text} | {rate:g}{' (knee)' if rate == k else ''} "
                     f"| {mark}{c_text}{mark} | {old_mark}{o_text}{old_mark} | {seconds} |")
            yield cells, old[rate], cand[rate]


def main() -> None:
    print("| sweep | knee (INFaaS++) | rate | round 6 (`prefill_ahead`): P99 TTFT INFaaS++/shoal, "
          "mean TTFT and P99 TPOT shoal/INFaaS++ | round 5 (`blocks_ahead`): the same "
          "| P99 TTFT s: INFaaS++ / round 5 / round 6 |")
    print("|---|---|---|---|---|---|")
    for cells, _, _ in rows(HERE, ROUND5):
        print(cells)


if __name__ == "__main__":
    main()
