"""Print the default-policy tables of docs/SIMULATION.md from the sweeps' median JSON files.

python docs/sim/policy/summarize.py            # every *-median.json next to this file
python docs/sim/policy/summarize.py docs/sim/policy4   # round 5 (corrected prefill cost)

In docs/sim/policy4 a sweep's baselines are ``PREFIX.json`` and shoal's default ``PREFIX_default.json``.
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


def _load(path: Path) -> list[dict[str, object]]:
    """The sweep's points, shoal's under its current default.

    ``shoal``: the default, blocks-ahead dispatch with the move of queued requests after 0.5 s
    (``*_shoal3*``); ``shoal-nomove``: the same without moving queued requests (round 2's default,
    ``*_shoal2*``, or the first runs of the chunked sweeps); ``shoal-prev``: the queue-aware
    freeness dispatch (``*_shoal60*``, or the first runs where no ``_shoal60`` file exists). The
    paper's threshold 30, the sum-of-bottlenecks dispatch and the 1 s move (``*_requeue*``) stay
    in the JSON only."""
    points: list[dict[str, object]] = json.loads(path.read_text())
    stem = path.name.removesuffix("-median.json").removesuffix(".json")
    suffix = "-median.json" if path.name.endswith("-median.json") else ".json"

    def sibling(tag: str) -> Path:
        return path.with_name(stem + tag + suffix)

    if sibling("_default").exists():  # round 5: the baselines' file and the default's beside it
        return [p for p in points if p["policy"] != "shoal"] + json.loads(sibling("_default").read_text())
    if sibling("_shoal60").exists():
        points = [p for p in points if p["policy"] != "shoal"] + json.loads(sibling("_shoal60").read_text())
    later = [tag for tag in ("_shoal2", "_shoal3") if sibling(tag).exists()]
    if later:  # the base file's shoal is an earlier default
        for p in points:
            if p["policy"] == "shoal":
                p["policy"] = "shoal-prev" if "_shoal2" in later else "shoal-nomove"
    if "_shoal2" in later:
        extra: list[dict[str, object]] = json.loads(sibling("_shoal2").read_text())
        for p in extra:
            p["policy"] = "shoal-nomove" if "_shoal3" in later else "shoal"
        points += extra
    if "_shoal3" in later:
        points += json.loads(sibling("_shoal3").read_text())
    return points


def table(path: Path) -> None:
    points = _load(path)
    workload = str(points[0]["workload"])
    policies = sorted({str(p["policy"]) for p in points})
    rates = sorted({float(p["rate"]) for p in points})
    by = {(float(p["rate"]), str(p["policy"])): p for p in points}
    knees = {name: knee(points, workload, name) for name in policies}
    print(f"\n#### {path.stem.removesuffix('-median')} ({workload}, {points[0]['workload_description']})\n")
    print(
        f"Knee (P99 TTFT within {KNEE_FACTOR:g}x of the lightest rate's): "
        + ", ".join(f"{n} {k:g}" for n, k in knees.items() if k is not None)
    )
    print()
    print(
        "| rate | policy | TTFT mean | TTFT P99 | TPOT P99 | migr. attempts | aborts (no room) | KV GB | "
        "most moves | rejected | P99 TTFT INFaaS++/shoal | mean TTFT shoal/INFaaS++ | "
        "P99 TPOT shoal/INFaaS++ | P99 TTFT llumnix/shoal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rate in rates:
        for name in policies:
            p = by.get((rate, name))
            if p is None:
                continue
            extra = ["", "", "", ""]
            s, i, ll = by.get((rate, name)), by.get((rate, "infaas")), by.get((rate, "llumnix"))
            if name in ("shoal", "shoal-nomove") and s and i:
                extra = [
                    f"{float(i['ttft_p99_s']) / float(s['ttft_p99_s']):.2f}x",
                    f"{float(s['ttft_mean_s']) / float(i['ttft_mean_s']):.2f}",
                    f"{float(s['tpot_p99_s']) / float(i['tpot_p99_s']):.2f}",
                    f"{float(ll['ttft_p99_s']) / float(s['ttft_p99_s']):.2f}x" if ll else "",
                ]
            print(
                f"| {rate:g} | {name} | {float(p['ttft_mean_s']):.2f} | {float(p['ttft_p99_s']):.2f} | "
                f"{float(p['tpot_p99_s']):.3f} | {float(p['migrations_started']):.0f} | "
                f"{float(p['migrations_aborted']):.0f} ({_no_room(p):.0f}) | "
                f"{float(p['migration_bytes']) / 1e9:.1f} | "
                f"{float(p['max_migrations_per_request']):.0f} | {float(p['rejected']):.0f} | "
                + " | ".join(extra)
                + " |"
            )
    _must_show(by, rates, knees.get("infaas"))
    _must_show(by, rates, knees.get("infaas"), "shoal-nomove")


def _must_show(
    by: dict[tuple[float, str], dict[str, object]],
    rates: list[float],
    knee_rate: float | None,
    name: str = "shoal",
) -> None:
    """The issue's thresholds for ``name`` against INFaaS++ and Llumnix, as counts over the rates."""
    rows = [(r, by[(r, name)], by[(r, "infaas")]) for r in rates if (r, name) in by and (r, "infaas") in by]
    if not rows:
        return
    p99 = sum(float(s["ttft_p99_s"]) <= float(i["ttft_p99_s"]) for _, s, i in rows)
    mean = sum(float(s["ttft_mean_s"]) <= 1.05 * float(i["ttft_mean_s"]) for _, s, i in rows)
    tpot = sum(float(s["tpot_p99_s"]) <= 1.05 * float(i["tpot_p99_s"]) for _, s, i in rows)
    attempts = sum(float(s["migrations_started"]) for _, s, _ in rows)
    no_room = sum(_no_room(s) for _, s, _ in rows)
    line = (
        f"\nMust show ({name}, {len(rows)} rates): P99 TTFT <= INFaaS++ at {p99}; mean TTFT <= 1.05x at "
        f"{mean}; P99 TPOT <= 1.05x at {tpot}; no-room aborts {no_room:.0f} of {attempts:.0f} attempts"
    )
    if knee_rate is not None and (knee_rate, name) in by:
        s, i = by[(knee_rate, name)], by[(knee_rate, "infaas")]
        ratio = float(i["ttft_p99_s"]) / float(s["ttft_p99_s"])
        line += f"; at INFaaS++'s knee ({knee_rate:g}): INFaaS++/shoal {ratio:.2f}x"
        if (knee_rate, "llumnix") in by:
            ll = by[(knee_rate, "llumnix")]
            line += f", llumnix/shoal {float(ll['ttft_p99_s']) / float(s['ttft_p99_s']):.2f}x"
    print(line + ".")


def priorities(path: Path) -> None:
    """High against normal priority, medians over seeds, from the raw runs."""
    runs = _load(path)
    groups: dict[tuple[float, str], list[dict[str, object]]] = {}
    for p in runs:
        groups.setdefault((float(p["rate"]), str(p["policy"])), []).append(p)
    print(f"\n#### {path.stem}: by priority class (medians over seeds)\n")
    print(
        "| rate | policy | high TTFT P99 | normal TTFT P99 | normal/high | high TTFT mean | "
        "normal TTFT mean | high E2E mean | normal E2E mean |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (rate, name), group in sorted(groups.items()):

        def med(cls: str, key: str, group: list[dict[str, object]] = group) -> float:
            values = sorted(float(g["by_priority"][cls][key]) for g in group)  # type: ignore[index]
            return values[len(values) // 2]

        hi, no = med("high", "ttft_p99_s"), med("normal", "ttft_p99_s")
        print(
            f"| {rate:g} | {name} | {hi:.3f} | {no:.3f} | {no / hi:.2f}x | "
            f"{med('high', 'ttft_mean_s'):.3f} | {med('normal', 'ttft_mean_s'):.3f} | "
            f"{med('high', 'e2e_mean_s'):.2f} | {med('normal', 'e2e_mean_s'):.2f} |"
        )


def _rerun(path: Path) -> bool:
    """A re-run or ablation file, folded into its base file's table (or kept as JSON only)."""
    return any(
        tag in path.name for tag in ("_shoal60", "_shoal2", "_shoal3", "_sumahead", "_requeue", "_default")
    )


def main() -> None:
    here = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    for path in sorted(here.glob("*-median.json")):
        if not _rerun(path):
            table(path)
    for path in sorted(here.glob("priorities*.json")):
        if not path.stem.endswith("-median") and not _rerun(path):
            priorities(path)


if __name__ == "__main__":
    main()
