"""Merge the sweeps of docs/policies.md's cache-aware comparison and write its tables and plots.

A workload may be swept in parts with the same options (some rates or policies each, with the
same ``--seeds`` and ``--unloaded-rate``, so that the SLO's unloaded run is the same deterministic
round-robin run in every part; the script refuses parts whose SLOs differ), and their median
points merge into one curve per policy; a later part's point of a policy and rate replaces an
earlier one's (a policy swept again). Usage::

    python docs/sim/cache-policies/report.py OUT_DIR TAG[,TAG...] WORKLOAD...

reads ``OUT_DIR/WORKLOAD-TAG-median.json`` and ``OUT_DIR/WORKLOAD-TAG-goodput.json``, writes
``WORKLOAD.json`` here (the median points, key numbers only, 4 significant digits, and the SLO
and goodput) and ``panel.png`` (one row per workload: P99 TTFT, mean TTFT and P99 TPOT against
rate, one line per policy), and prints the markdown tables.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from PIL import Image

from scheduler.sim.plots import plot_latency_vs_rate
from scheduler.sim.sweep import goodput

HERE = Path(__file__).parent
ORDER = ("rr", "infaas", "llumnix", "shoal", "kv", "prefix", "shoal-cost")
KEPT = (
    "workload", "rate", "policy", "seeds", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s",
    "tpot_p99_s", "slo_attainment", "prefix_cache_hit_rate", "migrations", "migrations_started",
    "migrations_aborted", "migration_bytes_per_migration", "migration_saved_share",
    "max_migrations_per_request", "requeues", "rejected", "preemptions", "running_max_over_mean",
    "hot_prefix_ttft_p99_s",
)


def merge(out: Path, workload: str, tags: list[str]) -> dict[str, object]:
    by_key: dict[tuple[object, object], dict[str, object]] = {}  # a later part replaces a point
    slo: dict[str, object] = {}
    for path in [out / f"{workload}-{tag}-median.json" for tag in tags]:
        if not path.exists():
            continue
        for point in json.loads(path.read_text()):
            by_key[point["policy"], point["rate"]] = {key: point[key] for key in KEPT if key in point}
        found = json.loads(path.with_name(path.name.replace("-median", "-goodput")).read_text())
        entry = next(iter(found.values()))
        if slo and slo["slo"] != entry["slo"]:
            raise SystemExit(f"{path}: another SLO than the other sweeps of {workload}")
        slo = {"unloaded": entry["unloaded"], "slo": entry["slo"]}
    points = list(by_key.values())
    for point in points:
        point["workload"] = workload
    policies = [p for p in ORDER if any(q["policy"] == p for q in points)]
    rates = {name: goodput(points, workload, name) for name in policies}
    return {**slo, "goodput": rates, "points": points}


def tables(workload: str, data: dict[str, object]) -> str:
    points = data["points"]
    assert isinstance(points, list)
    rates_met = data["goodput"]
    assert isinstance(rates_met, dict)
    policies = list(rates_met)
    rates = sorted({float(p["rate"]) for p in points})
    by = {(p["policy"], float(p["rate"])): p for p in points}
    lines = [f"| {workload} | goodput (req/s) | " + " | ".join(f"P99 TTFT @ {r:g}" for r in rates) + " |"]
    lines.append("|---" * (len(rates) + 2) + "|")
    for name in policies:
        cells = []
        for rate in rates:
            p = by.get((name, rate))
            cells.append("" if p is None else f"{p['ttft_p99_s']:.2f} s ({100 * p['slo_attainment']:.1f}%)")
        lines.append(f"| `{name}` | {rates_met[name]:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spread_table(workload: str, data: dict[str, object]) -> str:
    """Per policy and rate: the busiest instance's running requests over the mean, and the hot
    prompt's P99 TTFT."""
    points = data["points"]
    assert isinstance(points, list)
    policies = list(data["goodput"])  # type: ignore[call-overload]
    rates = sorted({float(p["rate"]) for p in points})
    by = {(p["policy"], float(p["rate"])): p for p in points}
    header = " | ".join(f"{r:g} req/s" for r in rates)
    lines = [f"| {workload}: max/mean running, hot P99 TTFT | {header} |"]
    lines.append("|---" * (len(rates) + 1) + "|")
    for name in policies:
        cells = []
        for rate in rates:
            p = by.get((name, rate))
            cells.append(
                "" if p is None or "running_max_over_mean" not in p
                else f"{p['running_max_over_mean']:.2f}, {p['hot_prefix_ttft_p99_s']:.2f} s"
            )
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def migration_lines(data: dict[str, object]) -> str:
    """Per migrating policy, summed over the rates: committed / attempts, the share of bytes the
    destinations held cached, bytes per migration, the most moves of one request."""
    points = data["points"]
    assert isinstance(points, list)
    out = []
    for name in data["goodput"]:  # type: ignore[attr-defined]
        mine = [p for p in points if p["policy"] == name and p.get("migrations_started")]
        if not mine:
            continue
        started = sum(p["migrations_started"] for p in mine)
        done = sum(p["migrations"] for p in mine)
        saved = [p["migration_saved_share"] for p in mine if p["migrations"]]
        per = [p["migration_bytes_per_migration"] for p in mine if p["migrations"]]
        most = max(p["max_migrations_per_request"] for p in mine)
        out.append(
            f"{name}: {done:g} of {started:g} attempts committed "
            f"({100 * (1 - done / started):.1f}% aborted), "
            f"saved share {min(saved, default=0):.2f}-{max(saved, default=0):.2f}, "
            f"{min(per, default=0) / 1e6:.0f}-{max(per, default=0) / 1e6:.0f} MB per migration, "
            f"at most {most:g} moves of one request"
        )
    return "\n".join(out)


def _rounded(value: object) -> object:
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return value


def main() -> None:
    out, tags = Path(sys.argv[1]), sys.argv[2].split(",")
    workloads = sys.argv[3:]
    every: list[dict[str, object]] = []
    for workload in workloads:
        data = merge(out, workload, tags)
        document = _rounded(data)
        (HERE / f"{workload}.json").write_text(json.dumps(document, separators=(",", ":")) + "\n")
        every.extend(data["points"])  # type: ignore[arg-type]
        print(tables(workload, data))
        print(spread_table(workload, data))
        print(migration_lines(data))
        print(json.dumps({"slo": data.get("slo"), "unloaded": data.get("unloaded")}))
        print()
    panel = plot_latency_vs_rate(every, HERE / "panel.png")  # one row per workload
    Image.open(panel).convert("RGB").quantize(colors=32).save(panel, optimize=True)  # a third the bytes


if __name__ == "__main__":
    main()
