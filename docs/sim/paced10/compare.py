"""Round 10 (docs/SIMULATION.md): round 9's three 3-seed outliers over 8 seeds, unpaced (the
default) against paced copies (``--copy-share 0.1``) with and without round 10's catch-up stage.

python docs/sim/paced10/compare.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
POINTS = (("mm13", "M-M 13"), ("sl6", "S-L 6"), ("pm12", "M-M 12, 10% high"))
VARIANTS = (
    ("unpaced", "unpaced (default)"), ("paced_round9", "paced, round 9"), ("paced", "paced, round 10"),
)
METRICS = (("ttft_p99_s", "P99 TTFT"), ("ttft_mean_s", "mean TTFT"), ("tpot_p99_s", "P99 TPOT"))


def _runs(path: Path) -> list[dict[str, float]]:
    runs = [r for r in json.loads(path.read_text()) if r["policy"] == "shoal"]
    return sorted(runs, key=lambda r: r["seed"])


def main() -> None:
    print("| point | variant | P99 TTFT per seed (s) | " + " | ".join(m for _, m in METRICS)
          + " | over unpaced: ratio of medians | median of per-seed ratios | paced / hurried |")
    print("|---|---|---|" + "---|" * len(METRICS) + "---|---|---|")
    for point, label in POINTS:
        base: dict[str, float] = {}
        base_runs: list[dict[str, float]] = []
        for variant, name in VARIANTS:
            path = HERE / f"{point}_{variant}.json"
            if not path.exists():
                continue
            runs = _runs(path)
            medians = {key: statistics.median(r[key] for r in runs) for key, _ in METRICS}
            base = base or medians
            base_runs = base_runs or runs
            per_seed = ", ".join(
                f"{statistics.median(r[key] / b[key] for r, b in zip(runs, base_runs, strict=True)):.2f}x"
                for key, _ in METRICS
            )
            seeds = ", ".join(f"{r['ttft_p99_s']:.1f}" for r in runs)
            cells = " | ".join(f"{medians[key]:.3f}" for key, _ in METRICS)
            ratios = ", ".join(f"{medians[key] / base[key]:.2f}x" for key, _ in METRICS)
            paced = sum(int(r.get("paced_copies", 0)) for r in runs)
            hurried = sum(int(r.get("hurried_copies", 0)) for r in runs)
            print(f"| {label} | {name} | {seeds} | {cells} | {ratios} | {per_seed} | {paced} / {hurried} |")


if __name__ == "__main__":
    main()
