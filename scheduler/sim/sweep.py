"""Rate sweeps: every (workload, rate, policy) combination, one simulation each.

The shape of the Llumnix paper's serving figures: for each workload, latency
against request rate, one line per policy. Runs go one after another in this
process (the simulator is single-threaded and deterministic; a run's result
does not depend on which others ran). Each point is the run's summary
(:meth:`SimResult.to_dict` without time series) plus ``workload``, ``rate`` and
``seed``.

Several seeds (``SweepSpec.seeds``) give independent samples: a synthetic mix
draws new arrivals and lengths, a trace takes the next window of its rows (seed
``k`` starts at row ``k * num_requests``). :func:`median_points` folds them into
one point per (workload, rate, policy) with the median of every number, and
:func:`knee` finds, per workload and policy, the highest rate whose median P99
TTFT stays within :data:`KNEE_FACTOR` times its value at the lightest rate.

**Goodput** (``SweepSpec.slo``): before the sweep, each workload runs unloaded
(:attr:`SweepSpec.unloaded_rate`, ``round-robin``, the prefix cache off, the same seeds: the
policy cannot matter when requests rarely overlap, and without the cache the bound does not
depend on how many prompts a short run happens to find cached, nor on the placement that
found them) and its median P50 TTFT and P50 TPOT set the SLO:
TTFT <= ``slo.ttft_factor`` x and TPOT <= ``slo.tpot_factor`` x those. Every run then
reports the share of its requests within both (``slo_attainment``; a rejected request
misses), and :func:`goodput` is, per policy, the highest rate swept at which (and at
every lighter rate) at least :data:`GOODPUT_SHARE` of requests met the SLO.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from scheduler.sim.config import PolicyName, PolicySetup, SimConfig, policy_setup
from scheduler.sim.metrics import SimResult
from scheduler.sim.simulator import ProgressCallback, simulate
from scheduler.sim.workload import Workload, build_workload

__all__ = [
    "GOODPUT_SHARE",
    "KNEE_FACTOR",
    "SloSpec",
    "SweepInputError",
    "SweepSpec",
    "WorkloadBuilder",
    "goodput",
    "knee",
    "median_points",
    "ratios",
    "run_sweep",
    "sweep_point",
    "unloaded_slo",
]

#: The knee of a latency curve: the highest rate whose P99 TTFT is at most this many times
#: the P99 TTFT at the lightest rate swept.
KNEE_FACTOR = 3.0
#: Goodput: the share of requests that must meet the SLO at a rate.
GOODPUT_SHARE = 0.99

#: A named workload the sweep builds itself: (requests, rate in req/s, seed) -> workload.
WorkloadBuilder = Callable[[int, float, int], Workload]


@dataclass(frozen=True, slots=True)
class SloSpec:
    """The SLO as multiples of the workload's unloaded P50 TTFT and TPOT, and the unloaded run:
    ``unloaded_requests`` requests at ``unloaded_rate`` req/s (None: a tenth of the lightest rate)."""

    ttft_factor: float = 5.0
    tpot_factor: float = 2.0
    unloaded_rate: float | None = None
    unloaded_requests: int = 100


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
    seeds: tuple[int, ...] = ()
    #: workloads built by name here (sessions, system-prompt groups), before traces and mixes
    builders: Mapping[str, WorkloadBuilder] = field(default_factory=dict)
    slo: SloSpec | None = None

    @property
    def run_seeds(self) -> tuple[int, ...]:
        """The seeds to run: ``seeds``, or just ``seed``."""
        return self.seeds or (self.seed,)

    @property
    def num_runs(self) -> int:
        return len(self.workloads) * len(self.rates) * len(self.setups) * len(self.run_seeds)

    @property
    def unloaded_rate(self) -> float:
        given = None if self.slo is None else self.slo.unloaded_rate
        return given if given is not None else min(self.rates) / 10.0

    def build(self, name: str, num_requests: int, rate: float, seed: int) -> Workload:
        """Workload ``name`` at ``rate`` (a builder's, or a trace window / mix; see run_sweep)."""
        builder = self.builders.get(name)
        if builder is not None:
            return builder(num_requests, rate, seed)
        return build_workload(
            name, num_requests=num_requests, rate=rate, cv=self.cv, seed=seed,
            high_share=self.high_share, start=seed * self.num_requests if self.seeds else 0,
        )


def sweep_point(workload: str, rate: float, result: SimResult, seed: int = 0) -> dict[str, object]:
    """One sweep point: the run's summary (no time series), its workload's name and description,
    its rate and seed."""
    point = result.to_dict(series=False)
    point["workload_description"] = point.pop("workload")
    point["workload"] = workload
    point["rate"] = rate
    point["seed"] = seed
    return point


class SweepInputError(ValueError):
    """A sweep's workloads cannot be built as asked (a trace window past its end, a bad file)."""


def run_sweep(
    spec: SweepSpec,
    base: SimConfig,
    *,
    on_start: Callable[[str, float, PolicySetup], ProgressCallback | None] | None = None,
    on_result: Callable[[dict[str, object]], None] | None = None,
    slos: Mapping[str, Mapping[str, Mapping[str, float]]] | None = None,
) -> list[dict[str, object]]:
    """Run every combination of ``spec`` on ``base`` (its ``setup`` replaced per policy).

    ``on_start`` may return a progress callback for the run; ``on_result``
    sees each point as soon as its run ends. With ``spec.slo``, ``slos`` are the workloads'
    :func:`unloaded_slo` (computed here when not given).
    """
    points: list[dict[str, object]] = []
    try:  # all built first: a bad trace window is an error before hours of runs, not after
        workloads = {
            (name, rate, seed): spec.build(name, spec.num_requests, rate, seed)
            for name in spec.workloads for rate in spec.rates for seed in spec.run_seeds
        }
    except ValueError as exc:
        raise SweepInputError(str(exc)) from exc
    if spec.slo and slos is None:
        slos = {name: unloaded_slo(spec, base, name) for name in spec.workloads}
    if len(spec.run_seeds) > 1:
        for (name, _rate, seed), workload in workloads.items():
            if len(workload.requests) < spec.num_requests:
                raise SweepInputError(
                    f"{name}: seed {seed} is rows {seed * spec.num_requests}-"
                    f"{(seed + 1) * spec.num_requests - 1} of the trace, which holds only "
                    f"{len(workload.requests)} of them: a median over seeds would mix window sizes "
                    f"(use fewer seeds or fewer --requests)"
                )
    for workload_name in spec.workloads:
        for rate in spec.rates:
            for seed in spec.run_seeds:
                workload = workloads[workload_name, rate, seed]
                for setup in spec.setups:
                    progress = None if on_start is None else on_start(workload_name, rate, setup)
                    slo = slos[workload_name]["slo"] if slos and spec.slo else None
                    config = replace(
                        base, setup=setup,
                        slo=None if slo is None else (float(slo["ttft_s"]), float(slo["tpot_s"])),
                    )
                    result = simulate(config, workload, on_progress=progress)
                    point = sweep_point(workload_name, rate, result, seed)
                    points.append(point)
                    if on_result is not None:
                        on_result(point)
    return points


def median_points(points: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    """One point per (workload, rate, policy): the median of every number over its seeds.

    ``seeds`` lists the seeds folded; a dict of numbers (abort reasons, moves per request) gets
    the median per key (absent: 0); other non-numeric fields come from the first point.
    """
    groups: dict[tuple[str, float, str], list[dict[str, object]]] = {}
    for p in points:
        groups.setdefault((str(p["workload"]), float(str(p["rate"])), str(p["policy"])), []).append(p)
    out: list[dict[str, object]] = []
    for (_, _, _), group in groups.items():
        merged = dict(group[0])
        for key, value in group[0].items():
            if isinstance(value, int | float) and not isinstance(value, bool) and key not in ("rate", "seed"):
                merged[key] = statistics.median(float(str(g[key])) for g in group)
            elif isinstance(value, dict) and all(isinstance(v, int | float) for v in value.values()):
                counts = [g.get(key) or {} for g in group]  # e.g. abort reasons: absent counts 0
                names = sorted({name for c in counts if isinstance(c, dict) for name in c})
                merged[key] = {
                    name: statistics.median(
                        float(c.get(name, 0)) if isinstance(c, dict) else 0.0 for c in counts
                    )
                    for name in names
                }
        merged["seeds"] = [g.get("seed", 0) for g in group]
        merged.pop("seed", None)
        out.append(merged)
    return out


def knee(points: Sequence[dict[str, object]], workload: str, policy: str) -> float | None:
    """The highest rate whose P99 TTFT is within :data:`KNEE_FACTOR` of the lightest rate's
    (``points``: one per rate, e.g. from :func:`median_points`); None without points."""
    curve = sorted(
        (float(str(p["rate"])), float(str(p["ttft_p99_s"])))
        for p in points if p["workload"] == workload and p["policy"] == policy
    )
    if not curve:
        return None
    limit = KNEE_FACTOR * curve[0][1]
    found = curve[0][0]
    for rate, p99 in curve:
        if p99 > limit:
            break
        found = rate
    return found


def ratios(points: Sequence[dict[str, object]], key: str, baseline: str, policy: str) -> dict[float, float]:
    """``baseline / policy`` of ``key`` per rate (for one workload's points)."""
    by = {(str(p["policy"]), float(str(p["rate"]))): float(str(p[key])) for p in points}
    out: dict[float, float] = {}
    for (name, rate), value in by.items():
        if name == policy and (baseline, rate) in by and value > 0:
            out[rate] = by[(baseline, rate)] / value
    return out


def unloaded_slo(spec: SweepSpec, base: SimConfig, workload: str) -> dict[str, dict[str, float]]:
    """The SLO of ``workload`` (``spec.slo`` required): its unloaded run per seed
    (``round-robin``, no migration, no prefix cache), the median P50 TTFT and TPOT over seeds,
    and the bounds."""
    slo = spec.slo
    if slo is None:
        raise ValueError("the sweep has no SLO")
    config = replace(base, setup=policy_setup(PolicyName.ROUND_ROBIN), slo=None, prefix_cache=False)
    try:
        runs = [
            simulate(config, spec.build(workload, slo.unloaded_requests, spec.unloaded_rate, seed))
            for seed in spec.run_seeds
        ]
    except ValueError as exc:
        raise SweepInputError(str(exc)) from exc
    ttft = statistics.median(r.ttft_p50_s for r in runs)
    tpot = statistics.median(r.tpot_p50_s for r in runs)
    return {
        "unloaded": {
            "rate": spec.unloaded_rate, "requests": float(slo.unloaded_requests), "prefix_cache": 0.0,
            "ttft_p50_s": ttft, "tpot_p50_s": tpot,
        },
        "slo": {
            "ttft_s": slo.ttft_factor * ttft, "tpot_s": slo.tpot_factor * tpot,
            "ttft_factor": slo.ttft_factor, "tpot_factor": slo.tpot_factor, "share": GOODPUT_SHARE,
        },
    }


def goodput(points: Sequence[dict[str, object]], workload: str, policy: str) -> float:
    """The highest rate at which, and at every lighter rate, at least :data:`GOODPUT_SHARE` of
    requests met the SLO (``points``: one per rate, e.g. medians); 0 when the lightest fails."""
    curve = sorted(
        (float(str(p["rate"])), float(str(p["slo_attainment"])))
        for p in points if p["workload"] == workload and p["policy"] == policy
    )
    found = 0.0
    for rate, share in curve:
        if share < GOODPUT_SHARE:
            break
        found = rate
    return found
