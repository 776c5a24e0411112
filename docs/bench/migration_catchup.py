"""Tenth session (SPEED.md): the catch-up stage after a paced stage, side by side with the commit
before it. Combines the runs of ``shoal bench migration --seq-lens 1024,4096 --repeats 3 --methods
live,paced`` (three on each commit, in alternation) into one JSON and one plot of the agent-side
downtime, live against paced.

python docs/bench/migration_catchup.py RUNS_DIR   # after{1,2,3}.json, before{1,2,3}.json there
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
NAME = "migration-catchup-2026-12-03"


def main(runs_dir: Path) -> None:
    runs = {
        side: [json.loads((runs_dir / f"{side}{i}.json").read_text()) for i in (1, 2, 3)]
        for side in ("before", "after")
    }
    summary = {}
    for side, side_runs in runs.items():
        for seq_len in (1024, 4096):
            rows = [row for run in side_runs for row in run if row["seq_len"] == seq_len]
            pick = {key: [row.get(key) for row in rows] for key in (
                "live_agent_ms", "paced_agent_ms", "step_ratio_paced", "step_ratio_live",
                "paced_stages", "live_last_stage_blocks", "paced_last_stage_blocks", "paced_copy_s")}
            pick["median_paced_over_live_agent_ms"] = statistics.median(
                p / q for p, q in zip(pick["paced_agent_ms"], pick["live_agent_ms"], strict=True))
            summary[f"{side} {seq_len}"] = pick
            print(side, seq_len, json.dumps(pick))
    out = {
        "commits": {"before": "9116ffd", "after": "9116ffd + the catch-up stage"},
        "command": "shoal bench migration --seq-lens 1024,4096 --repeats 3 --methods live,paced",
        "summary": summary,
        "runs": runs,
    }
    (HERE / f"{NAME}.json").write_text(json.dumps(out, indent=1))
    _plot(summary)


def _plot(summary: dict[str, dict[str, list]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(9, 4), sharey=True)
    for axis, seq_len in zip(axes, (1024, 4096), strict=True):
        for x, side in enumerate(("before", "after")):
            row = summary[f"{side} {seq_len}"]
            axis.scatter([x - 0.1] * 3, row["live_agent_ms"], color="tab:blue",
                         label="live" if x == 0 else None)
            axis.scatter([x + 0.1] * 3, row["paced_agent_ms"], color="tab:orange",
                         label="paced (0.1)" if x == 0 else None)
        axis.set_xticks([0, 1], ["9116ffd", "+ catch-up stage"])
        axis.set_title(f"{seq_len} tokens")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("agent-side downtime (ms), median of 3 per run")
    axes[0].legend()
    figure.suptitle("Paced migration: downtime with and without the catch-up stage (2 cores, kv-heavy)")
    figure.tight_layout()
    figure.savefig(HERE / f"{NAME}.png", dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
