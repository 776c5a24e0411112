"""PNG plots of simulation results (matplotlib, headless ``Agg`` backend).

* :func:`plot_latency_vs_rate` — one row per workload: P99 TTFT, mean TTFT and
  P99 time per output token against the request rate, one line per policy
  (the shape of the Llumnix paper's Fig. 11);
* :func:`plot_fragmentation` — fragmentation over time, one line per run;
* :func:`plot_instances` — instances held over time, one line per run.

Figures are small (about 100 dpi) so that committed PNGs stay light.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

__all__ = ["plot_fragmentation", "plot_instances", "plot_latency_vs_rate"]

_DPI = 72
_PANELS = (("ttft_p99_s", "P99 TTFT (s)"), ("ttft_mean_s", "mean TTFT (s)"), ("tpot_p99_s", "P99 TPOT (s)"))


def plot_latency_vs_rate(points: Sequence[Mapping[str, object]], path: str | Path) -> Path:
    """``points``: dicts with ``workload``, ``policy``, ``rate`` and the latency keys."""
    workloads = sorted({str(p["workload"]) for p in points})
    policies = sorted({str(p["policy"]) for p in points})
    fig, axes = plt.subplots(
        len(workloads), len(_PANELS), figsize=(4.2 * len(_PANELS), 3.0 * len(workloads)), squeeze=False
    )
    for row, workload in enumerate(workloads):
        for col, (key, label) in enumerate(_PANELS):
            ax = axes[row][col]
            for policy in policies:
                series = sorted(
                    ((float(str(p["rate"])), float(str(p[key]))) for p in points
                     if p["workload"] == workload and p["policy"] == policy),
                    key=lambda xy: xy[0],
                )
                if series:
                    ax.plot([x for x, _ in series], [y for _, y in series], marker="o", ms=3, label=policy)
            ax.set_yscale("log")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(label)
            ax.set_title(workload, fontsize=9)
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def _plot_series(
    series: Mapping[str, Sequence[tuple[float, float]]], path: str | Path, ylabel: str, *, percent: bool
) -> Path:
    fig, ax = plt.subplots(figsize=(7.0, 3.0))
    for name, points in sorted(series.items(), key=lambda item: item[0]):
        scale = 100.0 if percent else 1.0
        ax.plot([t for t, _ in points], [v * scale for _, v in points], lw=0.8, label=name)
    ax.set_xlabel("time (s)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def plot_fragmentation(series: Mapping[str, Sequence[tuple[float, float]]], path: str | Path) -> Path:
    """Fragmentation (% of cluster blocks) over time, one line per named run."""
    return _plot_series(series, path, "fragmentation (% of blocks)", percent=True)


def plot_instances(series: Mapping[str, Sequence[tuple[float, float]]], path: str | Path) -> Path:
    """Instances held over time, one line per named run."""
    return _plot_series(series, path, "instances", percent=False)


def _save(fig: Figure, path: str | Path) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=_DPI)
    plt.close(fig)
    return target
