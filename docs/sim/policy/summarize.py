"""Print the default-policy tables of docs/SIMULATION.md from the sweeps' median JSON files.

    python docs/sim/policy/summarize.py            # every *-median.json next to this file
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from scheduler.sim.sweep import KNEE_FACTOR, knee

HERE = Path(__file__).parent
NO_ROOM = ("out_of_blocks", "too_many_incoming")


def _no_room(point: dict[str, object]) -> float:
    reasons = point.get("migration_abort_reasons") or {}
    assert isinstance(reasons, dict)
    return float(sum(float(v) for k, v in reasons.items() if k in NO_ROOM))


def table(path: Path) -> None:
    points = json.loads(path.read_text())
    workload = str(points[0]["workload"])
    policies = sorted({str(p["policy"]) for p in points})
    rates = sorted({float(p["rate"]) for p in points})
    by = {(float(p["rate"]), str(p["policy"])): p for p in points}
    knees = {name: knee(points, workload, name) for name in policies}
    print(f"\n#### {path.stem.removesuffix('-median')} ({workload}, {points[0]['workload_description']})\n")
    print(f"Knee (P99 TTFT within {KNEE_FACTOR:g}x of the lightest rate's): "
          + ", ".join(f"{n} {k:g}" for n, k in knees.items() if k is not None))
    print()
    print("| rate | policy | TTFT mean | TTFT P99 | TPOT P99 | migr. attempts | aborts (no room) | KV GB | "
          "most moves | rejected | P99 TTFT INFaaS++/shoal | mean TTFT shoal/INFaaS++ | "
          "P99 TPOT shoal/INFaaS++ | P99 TTFT llumnix/shoal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rate in rates:
        for name in policies:
            p = by.get((rate, name))
            if p is None:
                continue
            extra = ["", "", "", ""]
            s, i, ll = by.get((rate, "shoal")), by.get((rate, "infaas")), by.get((rate, "llumnix"))
            if name == "shoal" and s and i:
                extra = [
                    f"{float(i['ttft_p99_s']) / float(s['ttft_p99_s']):.2f}x",
                    f"{float(s['ttft_mean_s']) / float(i['ttft_mean_s']):.2f}",
                    f"{float(s['tpot_p99_s']) / float(i['tpot_p99_s']):.2f}",
                    f"{float(ll['ttft_p99_s']) / float(s['ttft_p99_s']):.2f}x" if ll else "",
                ]
            print(f"| {rate:g} | {name} | {float(p['ttft_mean_s']):.2f} | {float(p['ttft_p99_s']):.2f} | "
                  f"{float(p['tpot_p99_s']):.3f} | {float(p['migrations_started']):.0f} | "
                  f"{float(p['migrations_aborted']):.0f} ({_no_room(p):.0f}) | "
                  f"{float(p['migration_bytes']) / 1e9:.1f} | "
                  f"{float(p['max_migrations_per_request']):.0f} | {float(p['rejected']):.0f} | "
                  + " | ".join(extra) + " |")


def priorities(path: Path) -> None:
    """High against normal priority, medians over seeds, from the raw runs."""
    runs = json.loads(path.read_text())
    groups: dict[tuple[float, str], list[dict[str, object]]] = {}
    for p in runs:
        groups.setdefault((float(p["rate"]), str(p["policy"])), []).append(p)
    print(f"\n#### {path.stem}: by priority class (medians over seeds)\n")
    print("| rate | policy | high TTFT P99 | normal TTFT P99 | normal/high | high TTFT mean | "
          "normal TTFT mean | high E2E mean | normal E2E mean |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (rate, name), group in sorted(groups.items()):
        def med(cls: str, key: str, group: list[dict[str, object]] = group) -> float:
            values = sorted(float(g["by_priority"][cls][key]) for g in group)  # type: ignore[index]
            return values[len(values) // 2]
        hi, no = med("high", "ttft_p99_s"), med("normal", "ttft_p99_s")
        print(f"| {rate:g} | {name} | {hi:.3f} | {no:.3f} | {no / hi:.2f}x | "
              f"{med('high', 'ttft_mean_s'):.3f} | {med('normal', 'ttft_mean_s'):.3f} | "
              f"{med('high', 'e2e_mean_s'):.2f} | {med('normal', 'e2e_mean_s'):.2f} |")


def main() -> None:
    for path in sorted(HERE.glob("*-median.json")):
        table(path)
    for path in sorted(HERE.glob("priorities*.json")):
        if not path.stem.endswith("-median"):
            priorities(path)


if __name__ == "__main__":
    main()
