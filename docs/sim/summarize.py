"""Print the markdown tables of docs/SIMULATION.md from the JSON results in docs/sim/.

Usage: python docs/sim/summarize.py [docs/sim]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
POLICY_ORDER = ("rr", "infaas", "llumnix-base", "llumnix", "shoal")


def _load(name: str) -> object:
    return json.loads((ROOT / name).read_text())


def _order(point: dict) -> tuple[float, int]:
    return (float(point["rate"]), POLICY_ORDER.index(point["policy"]))


def sweep_table(name: str) -> str:
    points = sorted(_load(name), key=_order)  # type: ignore[arg-type]
    rows = [
        "| rate | policy | TTFT mean | TTFT P50 | TTFT P99 | TPOT P99 | preempt. loss (s) | frag. "
        "| migr. (aborted) | churn |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        rows.append(
            f"| {p['rate']:g} | {p['policy']} | {p['ttft_mean_s']:.2f} | {p['ttft_p50_s']:.2f} | "
            f"{p['ttft_p99_s']:.2f} | {p['tpot_p99_s']:.3f} | {p['preemption_loss_s']:.0f} | "
            f"{100 * p['fragmentation_mean']:.2f}% | {p['migrations']} ({p['migrations_aborted']}) | "
            f"{100 * p['churn']:.2f}% |"
        )
    return "\n".join(rows)


def ratio_table(name: str, rate: float) -> str:
    points = {p["policy"]: p for p in _load(name) if float(p["rate"]) == rate}  # type: ignore[union-attr]
    shoal = points["shoal"]
    rows = ["| metric | INFaaS++ / shoal | round-robin / shoal | llumnix / shoal |", "|---|---|---|---|"]
    for key, label in (
        ("ttft_p99_s", "P99 TTFT"), ("ttft_mean_s", "mean TTFT"), ("tpot_p99_s", "P99 TPOT"),
        ("preemption_loss_s", "preemption loss"), ("fragmentation_mean", "fragmentation"),
    ):
        cells = []
        for other in ("infaas", "rr", "llumnix"):
            a, b = points[other][key], shoal[key]
            cells.append(f"{a / b:.2f}x" if b > 0 else ("=" if a == 0 else "inf"))
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def priority_table(cvs: tuple[int, ...]) -> str:
    rows = [
        "| CV | policy | high: TTFT mean | high: E2E mean | high: TPOT mean | normal: TTFT mean | "
        "normal: E2E mean | normal: TPOT mean |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cv in cvs:
        for p in sorted(_load(f"prio_cv{cv}.json"), key=_order):  # type: ignore[arg-type]
            h, n = p["by_priority"]["high"], p["by_priority"]["normal"]
            rows.append(
                f"| {cv} | {p['policy']} | {h['ttft_mean_s']:.3f} | {h['e2e_mean_s']:.2f} | "
                f"{h['tpot_mean_s']:.4f} | {n['ttft_mean_s']:.3f} | {n['e2e_mean_s']:.2f} | "
                f"{n['tpot_mean_s']:.4f} |"
            )
    return "\n".join(rows)


def autoscale_table(bands: tuple[int, ...]) -> str:
    rows = [
        "| band [x, x+50] | policy | instances (mean) | instance-s | run (s) | TTFT mean | TTFT P99 "
        "| TPOT P99 | migr. |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for x in bands:
        runs = _load(f"autoscale_x{x}.json")
        for policy in ("infaas", "shoal"):
            r = runs[policy]  # type: ignore[index]
            rows.append(
                f"| [{x}, {x + 50}] | {policy} | {r['instances_mean']:.2f} | "
                f"{r['instances_mean'] * r['virtual_s']:.0f} | {r['virtual_s']:.0f} | "
                f"{r['ttft_mean_s']:.2f} | "
                f"{r['ttft_p99_s']:.2f} | {r['tpot_p99_s']:.3f} | {r['migrations']} |"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    for name in ("azure_conv.json", "azure_code.json", "mm.json", "ls.json"):
        if (ROOT / name).exists():
            print(f"### {name}\n\n{sweep_table(name)}\n")
    if (ROOT / "azure_conv.json").exists():
        print(f"### ratios azure_conv @ 9\n\n{ratio_table('azure_conv.json', 9.0)}\n")
    if (ROOT / "mm.json").exists():
        print(f"### ratios mm @ 10\n\n{ratio_table('mm.json', 10.0)}\n")
    if (ROOT / "prio_cv8.json").exists():
        print(f"### priorities\n\n{priority_table((1, 2, 4, 8))}\n")
    if (ROOT / "autoscale_x40.json").exists():
        print(f"### autoscale\n\n{autoscale_table((2, 5, 10, 20, 40))}\n")
