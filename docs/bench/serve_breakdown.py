"""Eleventh session (SPEED.md): where ``shoal bench serve``'s gap to the engine alone comes from.

Pools the rounds of the ``serve-breakdown-*-2026-12-03.json`` runs (``shoal bench serve
--concurrency 32 --rounds 5 --engine-core thread|process``, two runs each, and ``--instances 2
--rounds 3``, two runs), prints the median of each factor per setup and plots every round: the
paired ratio (shoal's tokens/s over the direct engine's run right after it) and the three factors
of shoal's wall over the direct one's (steps, time per step, idle).

python docs/bench/serve_breakdown.py   # writes serve-breakdown-2026-12-03.png beside the JSON
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
NAME = "serve-breakdown-2026-12-03"
SETUPS = {"thread": "1 instance, engine core thread (default)", "process": "1 instance, engine core process",
          "2inst": "2 instances, engine core thread"}
FACTORS = ("ratio", "steps_factor", "step_s_factor", "idle_factor", "shoal_busy", "shoal_idle_ms")


def pooled_rounds(setup: str) -> list[dict[str, float]]:
    rounds = []
    for path in sorted(HERE.glob(f"serve-breakdown-{setup}-*-2026-12-03.json")):
        rounds.extend(json.loads(path.read_text())["results"]["32"]["rounds"])
    return rounds


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SETUPS), figsize=(15, 4.5), sharey=True)
    for ax, (setup, title) in zip(axes, SETUPS.items(), strict=True):
        rounds = pooled_rounds(setup)
        medians = {key: statistics.median(r[key] for r in rounds) for key in FACTORS}
        listed = ", ".join(f"{k} {v:.3f}" for k, v in medians.items())
        print(f"{title}: {len(rounds)} rounds, medians {listed}")
        x = range(1, len(rounds) + 1)
        ax.plot(x, [r["ratio"] for r in rounds], "ko-", label="paired ratio (shoal / direct tok/s)")
        ax.plot(x, [1 / r["steps_factor"] for r in rounds], "s--", label="1 / steps factor")
        ax.plot(x, [1 / r["step_s_factor"] for r in rounds], "^--", label="1 / time-per-step factor")
        ax.plot(x, [1 / r["idle_factor"] for r in rounds], "v--", label="1 / idle factor")
        ax.axhline(0.95, color="grey", lw=0.8, ls=":")
        ax.set_title(f"{title}\nmedian paired ratio {medians['ratio']:.3f}", fontsize=9)
        ax.set_xlabel("round (two runs pooled)")
    axes[0].set_ylabel("factor (1 = the engine alone)")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle("shoal bench serve, 32 streams, torch small: the per-round ratio and its three factors",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(HERE / f"{NAME}.png", dpi=110)
    print(f"wrote {HERE / f'{NAME}.png'}")


if __name__ == "__main__":
    main()
