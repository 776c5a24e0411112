"""One drill, start to end: cluster up, reference answers, steady load, fault, recovery, verdicts.

:func:`run_scenario` starts the scenario's cluster (or uses one given with
``--against``), follows the bus, records the greedy prompts' no-fault text
(torch and vllm engines; on the sim engine it is computed per request), sends
the load through the three phases with the fault injected and verified at
the start of the fault phase, stops the load, waits for every request to end,
checks the agents and the log, and returns a :class:`DrillResult`. Everything
it started — processes, proxies, the NATS store — is stopped and removed in a
``finally``, also when the drill is cancelled (the command line cancels it on
SIGINT/SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frontend.drill.cluster import DrillCluster, ExternalCluster
from frontend.drill.faults import FaultNotApplied, FaultRecord, inject
from frontend.drill.greedy import greedy_text
from frontend.drill.load import LoadGenerator, Outcome, RequestRecord
from frontend.drill.scenario import FaultKind, Scenario
from frontend.drill.verdicts import (
    AgentCheck,
    LogCheck,
    PrefixCheck,
    Verdict,
    check_agents,
    check_log,
    check_prefix_index,
    hanging,
    judge,
    latency_summary,
    ready_intervals,
    rescues,
)
from frontend.drill.watch import BusWatch
from frontend.supervisor import RestartPolicy

__all__ = ["DrillResult", "run_scenario"]


@dataclass
class DrillResult:
    scenario: Scenario
    passed: bool = False
    error: str | None = None
    verdicts: list[Verdict] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    latency: dict[str, dict[str, Any]] = field(default_factory=dict)
    recovery: dict[str, float | None] = field(default_factory=dict)
    agents: list[AgentCheck] = field(default_factory=list)
    log: LogCheck | None = None
    #: the scheduler's prefix index against the cache events (``expect_prefix_index``)
    prefix: PrefixCheck | None = None
    num_rescues: float | None = None
    #: requests that hung past the frontend's bound (None: the bound is unknown)
    num_hanging: int | None = None
    num_preemptions: int = 0
    duration_s: float = 0.0
    log_dir: str = ""

    def counts(self) -> dict[str, int]:
        return {o.value: sum(1 for r in self.records if r.outcome is o) for o in Outcome}


def _phase(record: RequestRecord, start: float | None, end: float | None) -> str:
    if start is None or record.sent_at < start:
        return "before"
    if end is None or record.sent_at < end:
        return "during"
    return "after"


def _recovery(result: DrillResult, watch: BusWatch) -> bool:
    faults = [f for f in result.faults if f.injected_at is not None]
    if not faults:
        return any(r.outcome is Outcome.OK for r in result.records)
    injected = faults[0].injected_at
    healed = max((f.healed_at or f.injected_at or 0.0) for f in faults)
    assert injected is not None
    ok_after = [
        r.ended_at
        for r in result.records
        if r.outcome is Outcome.OK and r.sent_at >= injected and r.ended_at is not None
    ]
    ok_after_heal = [
        r.ended_at
        for r in result.records
        if r.outcome is Outcome.OK and r.sent_at >= healed and r.ended_at is not None
    ]
    dispatch_after = [t for t, _ in watch.dispatches if t >= injected]
    result.recovery = {
        "first_ok_after_fault_s": min(ok_after) - injected if ok_after else None,
        "first_ok_after_heal_s": min(ok_after_heal) - healed if ok_after_heal else None,
        "first_dispatch_after_fault_s": min(dispatch_after) - injected if dispatch_after else None,
    }
    return bool(ok_after)


def rescue_bound(scenario: Scenario) -> float:
    """The frontend's bound on a request no instance can take, in the cluster the drill starts:
    the scenario's, else ``shoal serve``'s default."""
    if scenario.cluster.rescue_timeout_s is not None:
        return scenario.cluster.rescue_timeout_s
    from frontend.cli_serve import ServeCliConfig

    default = next(f.default for f in dataclasses.fields(ServeCliConfig) if f.name == "rescue_timeout")
    assert isinstance(default, float)
    return default


def restart_policy(scenario: Scenario) -> RestartPolicy:
    """The supervision the scenario's cluster gets (``shoal up``'s, with its delay and limit)."""
    spec = scenario.cluster
    return RestartPolicy(initial_delay_s=spec.restart_delay_s, max_delay_s=max(30.0, spec.restart_delay_s),
                         max_restarts=spec.max_restarts)


def _kills(faults: list[FaultRecord]) -> list[tuple[float, str]]:
    """When the drill killed which agent (its readiness ended there)."""
    kinds = (FaultKind.KILL.value, FaultKind.CRASH_LOOP.value)
    return [(f.injected_at, f.component) for f in faults
            if f.kind in kinds and f.component.startswith("agent") and f.injected_at is not None]


async def run_scenario(
    scenario: Scenario,
    *,
    log_dir: Path,
    against: ExternalCluster | None = None,
    echo: Callable[[str], None] = print,
    prefix: str = "drill",
) -> DrillResult:
    """Run one scenario; see the module docstring. Raises nothing for a failed drill: see ``result.error``."""
    started = time.monotonic()

    def clock() -> float:
        return time.monotonic() - started

    result = DrillResult(scenario, log_dir=str(log_dir))
    cluster: DrillCluster | ExternalCluster
    if against is not None:
        if scenario.fault.kind is not FaultKind.NONE:
            result.error = (
                "faults need a cluster the drill starts itself (--up); --against runs no-fault load"
            )
            return result
        cluster = against
    else:
        cluster = DrillCluster(scenario.cluster, log_dir, prefix=prefix, supervise=scenario.cluster.supervise,
                               restart_policy=restart_policy(scenario))
    watch: BusWatch | None = None
    load: LoadGenerator | None = None
    snapshots: dict[str, int] = {}

    def stats_sink(name: str, report: Any) -> None:
        snapshots[f"{name}@{clock():.3f}"] = int(report.num_preemptions)

    try:
        if isinstance(cluster, DrillCluster):
            echo(
                f"[{scenario.name}] starting the cluster ({scenario.cluster.instances} "
                f"{scenario.cluster.engine} agents), logs in {log_dir}"
            )
            await cluster.start()
        watch = BusWatch(cluster.nats_url, cluster.prefix, clock)
        await watch.start()
        await watch.seed_from_log()
        greedy = greedy_text(
            scenario.cluster.engine, cluster.model, scenario.load.output_tokens,
            external=not isinstance(cluster, DrillCluster),
        )
        load = LoadGenerator(scenario.load, cluster.url, cluster.model, clock, greedy)
        await load.record_references()
        phases = scenario.phases
        stop = asyncio.Event()
        load_task = asyncio.ensure_future(load.run(float("inf"), stop))
        result.phases["steady_start"] = clock()
        echo(f"[{scenario.name}] steady load {scenario.load.rate:g} req/s for {phases.steady_s:g}s")
        await asyncio.sleep(phases.steady_s)
        result.phases["fault_start"] = clock()
        if scenario.fault.kind is not FaultKind.NONE:
            echo(f"[{scenario.name}] fault: {scenario.fault.kind.value} {scenario.fault.target or ''}")
        if isinstance(cluster, DrillCluster):
            try:
                result.faults = await inject(
                    scenario.fault, phases.fault_s, cluster, watch, clock, stats_sink
                )
            except FaultNotApplied as exc:
                result.error = f"fault not applied: {exc}"
        else:
            await asyncio.sleep(phases.fault_s)
        result.phases["recovery_start"] = clock()
        await asyncio.sleep(phases.recovery_s)
        stop.set()
        await load_task
        result.phases["load_end"] = clock()
        echo(f"[{scenario.name}] load stopped ({len(load.records)} requests); waiting for them to end")
        await load.wait_all(scenario.load.request_timeout_s + 5)
        result.records = load.records
        agent_ids = cluster.live_agents() if isinstance(cluster, DrillCluster) else await cluster.instances()
        agent_ids = [a for a in agent_ids if a in watch.joined or not isinstance(cluster, DrillCluster)]
        result.agents = await check_agents(watch, agent_ids, settle_s=20.0)
        idle = cluster.idle_timeout_s if isinstance(cluster, DrillCluster) else 60.0
        result.log = await check_log(cluster.nats_url, cluster.prefix, settle_s=idle + 10.0)
        result.num_rescues = await rescues(cluster.url)
        if scenario.verdicts.expect_prefix_index:
            result.prefix = await check_prefix_index(cluster.nats_url, cluster.prefix,
                                                     [*load.references, *result.records], cluster.model)
        preempted = {s.split("@")[0]: n for s, n in sorted(snapshots.items())}
        result.num_preemptions = sum(a.num_preemptions for a in result.agents) + sum(
            n
            for name, n in preempted.items()
            if name not in agent_ids or scenario.fault.kind is FaultKind.ROLLING_RESTART
        )
        first = next((f.injected_at for f in result.faults if f.injected_at is not None), None)
        last = result.phases["recovery_start"] if first is not None else None
        by_phase: dict[str, list[RequestRecord]] = {"before": [], "during": [], "after": []}
        for record in result.records:
            by_phase[_phase(record, first, last)].append(record)
        result.latency = {name: latency_summary(rs) for name, rs in by_phase.items()}
        recovered = _recovery(result, watch)
        bound_s = rescue_bound(scenario) if isinstance(cluster, DrillCluster) else None
        result.num_hanging = hanging(result.records, result.faults, bound_s, scenario.verdicts.hang_margin_s)
        result.verdicts = judge(
            scenario,
            result.records,
            result.faults,
            result.agents,
            result.log,
            recovered=recovered,
            num_rescues=result.num_rescues,
            num_preemptions=result.num_preemptions,
            greedy_method=None if greedy is None else greedy.method,
            bound_s=bound_s,
            ready=ready_intervals(watch.lifecycle, _kills(result.faults), clock()),
            prefix=result.prefix,
            recovery_start=result.phases["recovery_start"],
        )
        result.passed = result.error is None and not any(v.failed for v in result.verdicts)
    except Exception as exc:  # the drill itself failed: report it, clean up below
        result.error = f"{type(exc).__name__}: {exc}"
        if load is not None:
            result.records = load.records
    finally:
        result.duration_s = clock()
        if load is not None:
            with contextlib.suppress(Exception):
                await load.close()
        if watch is not None:
            await watch.close()
        await cluster.close()
    return result
