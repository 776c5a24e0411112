"""Round 7 (docs/SIMULATION.md): migration copies paced to a tenth of a step (`--copy-share 0.1`,
opt-in), against round 6's unpaced copies (docs/sim/policy5, the default), medians of 3 seeds.
`everywhere/`: every stage of more than 4 blocks paced (an intermediate build); the top level:
paced unless the source is short of memory (`MigrationConfig.for_source`, what the option does).

python docs/sim/paced7/compare.py
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
UNPACED = HERE.parent / "policy5"
METRICS = (("P99 TTFT", "ttft_p99_s"), ("mean TTFT", "ttft_mean_s"), ("P99 TPOT", "tpot_p99_s"))


def _shoal(path: Path) -> dict[float, dict[str, float]]:
    return {float(p["rate"]): p for p in json.loads(path.read_text()) if p["policy"] == "shoal"}


def table(paced_dir: Path, title: str) -> None:
    print(f"\n{title}: paced / unpaced (> 1: pacing costs), migrations started / aborted unpaced -> paced\n")
    print("| sweep | rate | " + " | ".join(name for name, _ in METRICS) + " | migrations |")
    print("|---|---|" + "---|" * len(METRICS) + "---|")
    ratios: list[tuple[float, ...]] = []
    for path in sorted(paced_dir.glob("*_default-median.json")):
        base, paced = _shoal(UNPACED / path.name), _shoal(path)
        for rate, p in sorted(paced.items()):
            q = base[rate]
            if not q["migrations_started"] and not p["migrations_started"]:
                continue  # nothing migrated: identical runs
            r = tuple(p[key] / q[key] for _, key in METRICS)
            ratios.append(r)
            cells = " | ".join(f"{x:.2f}x" for x in r)
            moves = (f"{q['migrations_started']:.0f}/{q['migrations_aborted']:.0f} -> "
                     f"{p['migrations_started']:.0f}/{p['migrations_aborted']:.0f}")
            print(f"| {path.name.removesuffix('_default-median.json')} | {rate:g} | {cells} | {moves} |")
    for i, (name, _) in enumerate(METRICS):
        values = [r[i] for r in ratios]
        median = statistics.median(values)
        print(f"{name}: median {median:.3f}x, worst {max(values):.2f}x, best {min(values):.2f}x")


def main() -> None:
    table(HERE / "everywhere", "Every stage paced")
    table(HERE, "Paced unless the source is short of memory (what --copy-share 0.1 does)")


if __name__ == "__main__":
    sys.exit(main())
