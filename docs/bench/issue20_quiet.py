"""Issue 20's Must-show figures of one quiet run, in one plot (fifteenth session).

Reads the JSON that ``shoal bench serve``, ``bench cluster``, ``bench migration`` and
``bench vllm-serve`` wrote on 2026-12-04 (see SPEED.md, "Fifteenth session") and draws four
panels: the paired serve ratio of every round, the cluster's dispatch p99 and step lag with and
without the scheduler, the co-located decode step while migrating, and ``vllm bench serve``'s
TTFT against ``vllm serve``'s. Each panel marks the issue's target.

    python docs/bench/issue20_quiet.py [OUT.png]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).parent
DAY = "2026-12-04"


def _load(name: str) -> Any:
    return json.loads((HERE / f"{name}-{DAY}.json").read_text())


def _serve_rounds() -> list[float]:
    ratios: list[float] = []
    for run in ("serve-quiet", "serve-quiet-b", "serve-quiet-c"):
        ratios += [r["ratio"] for r in _load(run)["results"]["32"]["rounds"]]
    return ratios


def _cluster() -> dict[str, list[dict[str, Any]]]:
    phases: dict[str, list[dict[str, Any]]] = {}
    for row in _load("cluster-quiet"):
        if row["repeat"] != "median":
            phases.setdefault(row["phase"], []).append(row)
    return phases


def main(out: Path) -> None:
    figure, ((serve, cluster), (migration, vllm)) = plt.subplots(2, 2, figsize=(11, 8))

    ratios = _serve_rounds()
    serve.plot(range(1, len(ratios) + 1), ratios, "o", label="paired round")
    serve.axhline(statistics.median(ratios), color="C0", label=f"median {statistics.median(ratios):.3f}")
    serve.axhline(0.95, color="red", linestyle="--", label="target 0.95")
    two = _load("serve-quiet-2inst")["results"]["32"]
    two_ratio, ceiling = two["median_of_paired_ratios"], two["cpu_ceiling_ratio"]
    serve.axhline(two_ratio, color="C1", label=f"2 instances {two_ratio:.2f} (ceiling {ceiling:.2f})")
    serve.set(title="bench serve, 32 streams: shoal / engine alone", xlabel="round", ylabel="ratio")
    serve.legend(fontsize=8)

    phases = _cluster()
    names = [("rate100", "100 req/s"), ("rate500", "500 req/s"), ("nosched500", "500, no scheduler")]
    series = ((-0.2, ("dispatch_p99_ms", "dispatch p99")), (0.2, ("agent_step_lag_p99_ms", "step lag p99")))
    for offset, (key, label) in series:
        for i, (phase, _) in enumerate(names):
            values = [row[key] for row in phases[phase]]
            cluster.plot([i + offset] * len(values), values, "o", color="C0" if offset < 0 else "C2",
                         label=label if i == 0 else None)
    cluster.axhline(5.0, color="red", linestyle="--", label="dispatch target 5 ms")
    cluster.set_xticks(range(len(names)), [label for _, label in names])
    cluster.set(title="bench cluster, 64 sim instances (3 repeats)", ylabel="ms")
    cluster.legend(fontsize=8)

    rows = _load("migration-quiet")
    lengths = [str(row["seq_len"]) for row in rows]
    width = 0.35
    bars = ((-width / 2, "step_ratio_live", "live"), (width / 2, "step_ratio_paced", "paced (share 0.1)"))
    for shift, key, label in bars:
        migration.bar([i + shift for i in range(len(rows))], [row[key] for row in rows], width, label=label)
    migration.axhline(1.1, color="red", linestyle="--", label="target 1.1x")
    migration.set_xticks(range(len(rows)), lengths)
    migration.set(title="bench migration: co-located decode step, migrating / idle",
                  xlabel="tokens migrated", ylabel="ratio")
    migration.legend(fontsize=8)

    results = _load("vllm-serve-quiet")["results"]
    labels, medians = [], []
    for server in ("shoal", "shoal-torch"):
        for conc in sorted(results, key=int):
            labels.append(f"{'vllm' if server == 'shoal' else 'torch'} engine\nc={conc}")
            medians.append(results[conc][f"paired_{server}"]["median_ttft_p50_ratio"])
    vllm.bar(range(len(labels)), medians, color="C4")
    vllm.axhline(1.1, color="red", linestyle="--", label="target 1.1x")
    vllm.set_xticks(range(len(labels)), labels)
    vllm.set(title="vllm bench serve: TTFT p50, shoal up / vllm serve (median of paired rounds)",
             ylabel="ratio")
    vllm.title.set_fontsize(9)
    vllm.legend(fontsize=8)

    figure.suptitle(f"issue 20 on a quiet 2-core machine, {DAY}")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / f"issue20-quiet-{DAY}.png")
