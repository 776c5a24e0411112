"""Round 6 (docs/SIMULATION.md): per-priority TTFT of sweep JSON files, per seed and as medians.

    python docs/sim/priorities6/classes.py docs/sim/policy4/priorities_mm_default.json \
        docs/sim/priorities6/*.json

Prints, per file, policy and rate: high and normal P99 TTFT and their ratio (medians over seeds, as
the round-5 tables: the ratio is of the medians), the per-seed ratios, normal mean TTFT and P99 TPOT.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from typing import Any


def main(paths: list[str]) -> None:
    print("| file | policy | rate | high P99 | normal P99 | normal/high | per seed | normal mean "
          "| P99 TPOT |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        if path.endswith("-median.json"):
            continue
        groups: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
        with open(path) as f:
            points_in = json.load(f)
        for point in points_in:
            if "high" in point["by_priority"]:
                groups[(point["policy"], point["rate"])].append(point)
        for (policy, rate), points in sorted(groups.items()):
            high = [p["by_priority"]["high"]["ttft_p99_s"] for p in points]
            normal = [p["by_priority"]["normal"]["ttft_p99_s"] for p in points]
            per_seed = " ".join(f"{n / h:.2f}" for h, n in zip(high, normal, strict=True))
            mh, mn = statistics.median(high), statistics.median(normal)
            nmean = statistics.median(p["by_priority"]["normal"]["ttft_mean_s"] for p in points)
            tpot = statistics.median(p["tpot_p99_s"] for p in points)
            name = path.split("/")[-1].removesuffix(".json")
            print(f"| {name} | {policy} | {rate:g} | {mh:.3f} | {mn:.3f} | {mn / mh:.2f}x | {per_seed} "
                  f"| {nmean:.3f} | {tpot:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
