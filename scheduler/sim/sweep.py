"""Rate sweeps: every (workload, rate, policy) combination, one simulation each.

The shape of the Llumnix paper's serving figures: for each workload, latency
against request rate, one line per policy. Runs go one after another in this
process (the simulator is single-threaded and deterministic; a run's result
does not depend on which others ran). Each point is the run's summary
(:meth:`SimResult.to_dict` without time series) plus ``workload`` and ``rate``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from scheduler.sim.config import PolicySetup, SimConfig
from scheduler.sim.metrics import SimResult
from scheduler.sim.simulator import ProgressCallback, simulate
from scheduler.sim.workload import build_workload

__all__ = ["SweepSpec", "ratios", "run_sweep", "sweep_point"]


@dataclass(frozen=True, slots=True)
class SweepSpec:
    """What to sweep. ``setups`` are resolved policies (see :func:`scheduler.sim.config.policy_setup`)."""

    workloads: tuple[str, ...]
    rates: tuple[float, ...]
    setups: tuple[PolicySetup, ...]
    num_requests: int
    cv: float = 1.0
    seed: int = 0
    high_share: float = 0.0

    @property
    def num_runs(self) -> int:
        return len(self.workloads) * len(self.rates) * len(self.setups)


def sweep_point(workload: str, rate: float, result: SimResult) -> dict[str, object]:
    """One sweep point: the run's summary (no time series), its workload's name and description, its rate."""
    point = result.to_dict(series=False)
    point["workload_description"] = point.pop("workload")
    point["workload"] = workload
    point["rate"] = rate
    return point


def run_sweep(
    spec: SweepSpec,
    base: SimConfig,
    *,
    on_start: Callable[[str, float, PolicySetup], ProgressCallback | None] | None = None,
    on_result: Callable[[dict[str, object]], None] | None = None,
) -> list[dict[str, object]]:
    """Run every combination of ``spec`` on ``base`` (its ``setup`` replaced per policy).

    ``on_start`` may return a progress callback for the run; ``on_result``
    sees each point as soon as its run ends.
    """
    points: list[dict[str, object]] = []
    for workload_name in spec.workloads:
        for rate in spec.rates:
            workload = build_workload(
                workload_name, num_requests=spec.num_requests, rate=rate, cv=spec.cv, seed=spec.seed,
                high_share=spec.high_share,
            )
            for setup in spec.setups:
                progress = None if on_start is None else on_start(workload_name, rate, setup)
                result = simulate(replace(base, setup=setup), workload, on_progress=progress)
                point = sweep_point(workload_name, rate, result)
                points.append(point)
                if on_result is not None:
                    on_result(point)
    return points


def ratios(points: Sequence[dict[str, object]], key: str, baseline: str, policy: str) -> dict[float, float]:
    """``baseline / policy`` of ``key`` per rate (for one workload's points)."""
    by = {(str(p["policy"]), float(str(p["rate"]))): float(str(p[key])) for p in points}
    out: dict[float, float] = {}
    for (name, rate), value in by.items():
        if name == policy and (baseline, rate) in by and value > 0:
            out[rate] = by[(baseline, rate)] / value
    return out
