"""Where ``shoal bench serve``'s wall time goes: engine steps, and the engine waiting between them.

Both sides of the benchmark run the same engine code, whose step time
(``StepResult.duration_s``: plan, forward pass, sampling, bookkeeping) each side
sums: the direct engine in its loop, an agent in its
``shoal_agent_step_duration_seconds`` histogram, read from its ``/metrics``
before and after the measured burst. The ratio of the two walls then splits
exactly into

* **step time**: shoal's summed step time over the direct engine's, itself
  more steps (a burst whose first request arrives alone runs a step for it
  before the others are admitted) times a longer step (the same work computing
  slower, e.g. beside the frontend and the clients on the same cores);
* **idle**: the share of the wall the engine was *not* stepping, shoal's over
  the direct engine's: the agent's loop between steps, the bus, HTTP and the
  time before the first request arrives.

``shoal wall / direct wall = step time factor x idle factor`` (per instance:
with ``N`` instances the busy share is the summed step time over ``N`` walls).
"""

from __future__ import annotations

import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["StepTotals", "breakdown_table", "scrape_step_totals", "step_breakdown"]

_STEP_METRIC = "shoal_agent_step_duration_seconds"


@dataclass(frozen=True, slots=True)
class StepTotals:
    """Engine steps taken and the seconds they took, summed (over instances too)."""

    steps: int = 0
    seconds: float = 0.0

    def __sub__(self, earlier: StepTotals) -> StepTotals:
        return StepTotals(self.steps - earlier.steps, self.seconds - earlier.seconds)

    def __add__(self, other: StepTotals) -> StepTotals:
        return StepTotals(self.steps + other.steps, self.seconds + other.seconds)


def scrape_step_totals(metrics_urls: Sequence[str], timeout_s: float = 5.0) -> StepTotals:
    """The agents' step count and summed step seconds so far, from their Prometheus ``/metrics``."""
    total = StepTotals()
    for url in metrics_urls:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read().decode()
        steps, seconds = None, None
        for family in text_string_to_metric_families(text):
            if family.name != _STEP_METRIC:
                continue
            for sample in family.samples:
                if sample.name == f"{_STEP_METRIC}_count":
                    steps = int(sample.value)
                elif sample.name == f"{_STEP_METRIC}_sum":
                    seconds = float(sample.value)
        if steps is None or seconds is None:
            raise RuntimeError(f"{url} has no {_STEP_METRIC} histogram")
        total = total + StepTotals(steps, seconds)
    return total


def step_breakdown(
    shoal: StepTotals, shoal_wall_s: float, direct: StepTotals, direct_wall_s: float, *, instances: int = 1
) -> dict[str, float]:
    """The two factors of shoal's wall over the direct engine's, and what they are made of.

    ``busy``: the share of the wall an engine was stepping (summed step time over ``instances``
    walls); ``step_time_factor`` = ``steps_factor`` x ``step_s_factor``; ``idle_factor`` =
    direct busy / shoal busy. ``wall_factor`` is their product, shoal's wall over the direct one's.
    ``*_idle_ms``: the wall an engine was not stepping (per engine, on average over ``instances``).
    """
    measured = min(shoal.steps, direct.steps, shoal.seconds, direct.seconds, shoal_wall_s, direct_wall_s)
    if measured <= 0:
        keys = ("shoal_busy", "direct_busy", "steps_factor", "step_s_factor", "step_time_factor",
                "idle_factor", "wall_factor", "shoal_idle_ms", "direct_idle_ms")
        return {key: float("nan") for key in keys}
    shoal_busy = shoal.seconds / (instances * shoal_wall_s)
    direct_busy = direct.seconds / (instances * direct_wall_s)
    steps_factor = shoal.steps / direct.steps
    step_s_factor = (shoal.seconds / shoal.steps) / (direct.seconds / direct.steps)
    return {
        "shoal_busy": shoal_busy,
        "direct_busy": direct_busy,
        "steps_factor": steps_factor,
        "step_s_factor": step_s_factor,
        "step_time_factor": steps_factor * step_s_factor,
        "idle_factor": direct_busy / shoal_busy,
        "wall_factor": shoal_wall_s / direct_wall_s,
        "shoal_idle_ms": 1000 * (shoal_wall_s - shoal.seconds / instances),
        "direct_idle_ms": 1000 * (direct_wall_s - direct.seconds / instances),
    }


def breakdown_table(rows: dict[int, dict[str, Any]]) -> list[str]:
    """``shoal bench serve``'s lines for :func:`step_breakdown`, one per concurrency: the median
    of the rounds' paired ratios, then the median of each factor over the rounds."""
    lines = [
        "where shoal's wall goes, medians over the rounds (shoal wall / direct wall = steps x time per step"
        " x idle; busy: share of the wall an engine was stepping):",
        f"{'streams':>8} {'paired ratio':>13} {'wall':>6} {'= steps':>8} {'x per step':>11} {'x idle':>7}"
        f" {'busy shoal':>11} {'busy direct':>12} {'idle ms':>8} {'steps shoal/direct':>19}",
    ]
    for streams, row in rows.items():
        split = row["wall_breakdown"]
        lines.append(
            f"{streams:>8} {row['median_of_paired_ratios']:>13.3f} {split['wall_factor']:>6.3f}"
            f" {split['steps_factor']:>8.3f} {split['step_s_factor']:>11.3f} {split['idle_factor']:>7.3f}"
            f" {split['shoal_busy']:>11.1%} {split['direct_busy']:>12.1%} {split['shoal_idle_ms']:>8.0f}"
            f" {row['shoal_steps']:>10.0f}/{row['direct_steps']:.0f}"
        )
    return lines
