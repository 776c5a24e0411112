"""Round 9 (docs/SIMULATION.md): paced migration copies that hurry (`--copy-share 0.1`), against
round 6's unpaced copies (docs/sim/policy5, the default) and round 7's pacing (docs/sim/paced7),
medians of 3 seeds; then the two worst cases of round 7 over 8 seeds (knee8/).

python docs/sim/paced9/compare.py
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
UNPACED, ROUND7 = HERE.parent / "policy5", HERE.parent / "paced7"
METRICS = (("P99 TTFT", "ttft_p99_s"), ("mean TTFT", "ttft_mean_s"), ("P99 TPOT", "tpot_p99_s"))


def _shoal(path: Path) -> dict[float, dict[str, float]]:
    return {float(p["rate"]): p for p in json.loads(path.read_text()) if p["policy"] == "shoal"}


def sweeps() -> None:
    print("\nPaced copies that hurry (round 9) and round 7's, over unpaced (> 1: pacing costs); "
          "medians of 3 seeds\n")
    print("| sweep | rate | " + " | ".join(f"{name} r7 / r9" for name, _ in METRICS) + " | paced / hurried |")
    print("|---|---|" + "---|" * len(METRICS) + "---|")
    ratios: dict[str, list[tuple[float, ...]]] = {"r7": [], "r9": []}
    for path in sorted(HERE.glob("*_default-median.json")):
        base, r7, r9 = _shoal(UNPACED / path.name), _shoal(ROUND7 / path.name), _shoal(path)
        runs = json.loads(path.with_name(path.name.replace("-median", "")).read_text())
        for rate, p in sorted(r9.items()):
            q = base[rate]
            if not q["migrations_started"] and not p["migrations_started"]:
                continue  # nothing migrated: identical runs
            a = tuple(r7[rate][key] / q[key] for _, key in METRICS)
            b = tuple(p[key] / q[key] for _, key in METRICS)
            ratios["r7"].append(a)
            ratios["r9"].append(b)
            seeds = [r for r in runs if float(r["rate"]) == rate and r["policy"] == "shoal"]
            paced = sum(r.get("paced_copies", 0) for r in seeds)
            hurried = sum(r.get("hurried_copies", 0) for r in seeds)
            cells = " | ".join(f"{x:.2f}x / {y:.2f}x" for x, y in zip(a, b, strict=True))
            name = path.name.removesuffix("_default-median.json")
            print(f"| {name} | {rate:g} | {cells} | {paced} / {hurried} |")
    for label, rows in ratios.items():
        for i, (name, _) in enumerate(METRICS):
            values = [r[i] for r in rows]
            print(f"{label} {name}: median {statistics.median(values):.3f}x, worst {max(values):.2f}x")


def knee8() -> None:
    print("\nThe worst cases over 8 seeds (P99 TTFT per seed; median P99 TTFT, mean TTFT, P99 TPOT)\n")
    for name in ("sl", "pm"):
        for share in ("0", "round7", "0.1"):
            path = HERE / "knee8" / f"{name}_{share}.json"
            if not path.exists():
                continue
            runs = [p for p in json.loads(path.read_text()) if p["policy"] == "shoal"]
            p99 = [p["ttft_p99_s"] for p in runs]
            med = [statistics.median(p[key] for p in runs) for _, key in METRICS]
            print(f"{name} share {share}: per seed {[round(v, 2) for v in p99]}; medians "
                  + ", ".join(f"{m:.3f}" for m in med))


def main() -> None:
    sweeps()
    knee8()


if __name__ == "__main__":
    sys.exit(main())
