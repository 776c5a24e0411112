"""Forward what-if: a recorded run's arrivals through the simulator, under its policy and another.

``shoal replay --what-if-policy P --simulate [--from T --to T]`` (see
:mod:`scheduler.sim.replay_command`). From the log of a window:

* the **workload**: every request that arrived (``RequestArrived``: server time,
  prompt length, priority) with the output length it finished with
  (``RequestFinished``; ``max_tokens`` for one that did not finish in the log);
* the **instances**: those live at the window's start (``InstanceJoined``
  without a later ``InstanceLeft``/``InstanceFailed``), their capacity and
  batch size;
* the **policy**: the configuration the scheduler's epoch recorded;
* the **step-time profile**: the built-in profile whose model identity and KV
  layout the instances announced, scaled by one factor measured from the log:
  the one that makes the simulated median time per output token under the
  recorded policy the recorded one (bracketed, then bisected; the agents'
  ``--time-scale`` and the machine's own delays are in that factor);
* what was **recorded**: TTFT and end-to-end latency (``RequestFirstToken``,
  ``RequestFinished``), time per output token, preemptions and migrations.

The simulator then runs the workload under the recorded policy and under
``P``. The first run validates the model: its TTFT/TPOT percentiles are shown
next to the recorded ones with the relative error; the second is the
prediction. Requests are simulated from the window's first arrival with an
empty cluster (load from before the window is not carried over).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import msgspec
import numpy as np

from agents.engines.profile import BUILTIN_PROFILES, EngineProfile, load_profile
from scheduler.config import SHOAL_REQUEUE_AFTER_S, DispatchPolicy, PolicyConfig, decode_policy
from scheduler.logfile import RecordedLog
from scheduler.sim.config import PolicyName, PolicySetup, SimConfig
from scheduler.sim.metrics import RequestRecord
from scheduler.sim.simulator import Simulator
from scheduler.sim.workload import SimRequest, Workload
from schemas.decisions import SchedulerTick
from schemas.envelope import Codec
from schemas.instance import InstanceFailed, InstanceJoined, InstanceLeft
from schemas.migration import CommitAck
from schemas.requests import RequestArrived, RequestFinished, RequestFirstToken, RequestPreempted

__all__ = [
    "Latency",
    "Outcome",
    "RecordedRun",
    "WhatIfError",
    "WhatIfReport",
    "forward_what_if",
    "profile_for",
    "recorded_run",
    "simulate_run",
]

#: Rounds (to bracket, then to bisect) and tolerance of the step-time calibration: the recorded TPOT
#: P50 against the simulated one.
CALIBRATION_ROUNDS = 10
CALIBRATION_TOLERANCE = 0.02

_POLICY_NAMES: dict[DispatchPolicy, PolicyName] = {
    DispatchPolicy.ROUND_ROBIN: PolicyName.ROUND_ROBIN,
    DispatchPolicy.INFAAS: PolicyName.INFAAS,
    DispatchPolicy.FREENESS: PolicyName.LLUMNIX,
}


def _policy_name(dispatch: DispatchPolicy) -> PolicyName:
    """The simulator's name for a recorded dispatch rule: shoal's default and the superseded rules
    (which all migrate with priorities) run as ``shoal``."""
    return _POLICY_NAMES.get(dispatch, PolicyName.SHOAL)


class WhatIfError(ValueError):
    """The log cannot drive a simulation (no arrivals, no instances, no profile for its engine)."""


class Latency(msgspec.Struct, frozen=True):
    """P50/P99 of TTFT, time per output token and end-to-end latency (seconds) of ``count`` requests."""

    count: int
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    e2e_p50: float
    e2e_p99: float


class Outcome(msgspec.Struct, frozen=True):
    policy: str
    latency: Latency
    preemptions: int
    migrations: int


class RecordedRun(msgspec.Struct, frozen=True):
    workload: Workload
    instance: InstanceJoined
    num_instances: int
    policy: PolicyConfig
    recorded: Outcome
    start: float
    end: float


class WhatIfReport(msgspec.Struct, frozen=True):
    run_start: float
    run_end: float
    num_requests: int
    num_instances: int
    profile: str
    #: The measured step-time factor applied to the profile.
    time_scale: float
    recorded: Outcome
    simulated_recorded: Outcome
    simulated_what_if: Outcome
    #: (simulated - recorded) / recorded under the recorded policy, per percentile name.
    errors: dict[str, float]


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else 0.0


def latency_of(ttft: Sequence[float], tpot: Sequence[float], e2e: Sequence[float]) -> Latency:
    return Latency(
        count=len(e2e),
        ttft_p50=_pct(ttft, 50), ttft_p99=_pct(ttft, 99),
        tpot_p50=_pct(tpot, 50), tpot_p99=_pct(tpot, 99),
        e2e_p50=_pct(e2e, 50), e2e_p99=_pct(e2e, 99),
    )  # fmt: skip


def _policy_before(codec: Codec, log: RecordedLog, until: float) -> PolicyConfig:
    policy = PolicyConfig()
    for entry in log.events:
        if entry.time > until:
            break
        envelope = codec.decode_or_none(entry.data)
        if envelope is not None and isinstance(envelope.body, SchedulerTick) and envelope.body.policy:
            try:
                policy = decode_policy(envelope.body.policy)
            except ValueError:
                pass
    return policy


def recorded_run(log: RecordedLog, *, since: float | None = None, until: float | None = None) -> RecordedRun:
    """The workload, instances, policy and recorded latencies of ``log`` within [since, until]."""
    codec = Codec()
    arrivals: dict[str, tuple[float, RequestArrived]] = {}
    finished: dict[str, RequestFinished] = {}
    first_tokens: dict[str, RequestFirstToken] = {}
    live: dict[str, InstanceJoined] = {}
    preemptions = migrations = 0
    lo = float("-inf") if since is None else since
    hi = float("inf") if until is None else until
    for entry in log.events:
        envelope = codec.decode_or_none(entry.data)
        if envelope is None:
            continue
        body = envelope.body
        if isinstance(body, InstanceJoined) and entry.time <= hi:
            live[body.instance_id] = body
        elif isinstance(body, (InstanceLeft, InstanceFailed)) and entry.time < lo:
            live.pop(body.instance_id, None)
        elif isinstance(body, RequestArrived) and lo <= entry.time <= hi:
            arrivals[body.request_id] = (entry.time, body)
        elif isinstance(body, RequestFinished):
            finished[body.request_id] = body
        elif isinstance(body, RequestFirstToken):
            first_tokens[body.request_id] = body
        elif isinstance(body, RequestPreempted) and lo <= entry.time <= hi:
            preemptions += 1
        elif isinstance(body, CommitAck) and lo <= entry.time <= hi:
            migrations += 1
    if not arrivals:
        raise WhatIfError("no request arrived in the log's window (RequestArrived events)")
    if not live:
        raise WhatIfError("no instance was live in the log's window (InstanceJoined events)")
    start = min(t for t, _ in arrivals.values())
    end = max(t for t, _ in arrivals.values())
    requests = []
    ttft: list[float] = []
    tpot: list[float] = []
    e2e: list[float] = []
    for request_id, (at, arrived) in sorted(arrivals.items(), key=lambda item: (item[1][0], item[0])):
        done = finished.get(request_id)
        first = first_tokens.get(request_id)
        outputs = done.num_output_tokens if done is not None else arrived.max_tokens
        requests.append(
            SimRequest(
                request_id=request_id, arrival_s=at - start, num_prompt_tokens=arrived.num_prompt_tokens,
                num_output_tokens=max(1, outputs), priority=arrived.priority,
            )
        )  # fmt: skip
        if done is not None and first is not None:
            ttft.append(first.ttft_s)
            e2e.append(done.e2e_s)
            if done.num_output_tokens > 1:
                tpot.append((done.e2e_s - first.ttft_s) / (done.num_output_tokens - 1))
    template = next(iter(live.values()))
    policy = _policy_before(codec, log, end)
    recorded = Outcome(policy.dispatch_policy.value, latency_of(ttft, tpot, e2e), preemptions, migrations)
    workload = Workload(requests=tuple(requests), description=f"recorded log, {len(requests)} requests")
    return RecordedRun(workload, template, len(live), policy, recorded, start, end)


def profile_for(instance: InstanceJoined, names: Iterable[str] = BUILTIN_PROFILES) -> EngineProfile:
    """The built-in profile of ``instance``'s model identity and KV layout, with its capacity."""
    for name in names:
        profile = load_profile(name)
        if profile.model_identity == instance.model and profile.kv_layout == instance.kv_layout:
            return msgspec.structs.replace(
                profile, num_blocks=instance.num_blocks, max_batch_size=instance.max_batch_size
            )
    raise WhatIfError(
        f"no step-time profile for model {instance.model.model_id!r} with this KV layout "
        f"(built-in profiles: {', '.join(names)}); the what-if simulates sim-engine profiles only"
    )


def scaled(profile: EngineProfile, factor: float) -> EngineProfile:
    """``profile`` with every step time multiplied by ``factor``."""
    ms = [[v * factor for v in row] for row in profile.decode.ms]
    decode = msgspec.structs.replace(profile.decode, ms=ms)
    prefill = msgspec.structs.replace(profile.prefill, ms=[v * factor for v in profile.prefill.ms])
    return msgspec.structs.replace(profile, decode=decode, prefill=prefill)


def _simulated_latency(records: Iterable[RequestRecord]) -> Latency:
    done = [r for r in records if r.finish_s >= 0]
    return latency_of(
        [r.first_token_s - r.arrival_s for r in done],
        [(r.finish_s - r.first_token_s) / (r.num_output_tokens - 1) for r in done if r.num_output_tokens > 1],
        [r.finish_s - r.arrival_s for r in done],
    )


def simulate_run(
    run: RecordedRun,
    policy: PolicyConfig,
    profile: EngineProfile,
    *,
    report_interval_s: float = 0.1,
    pairing_interval_s: float = 0.5,
) -> Outcome:
    """The workload of ``run`` on its instances under ``policy``, in the simulator."""
    setup = PolicySetup(
        name=_policy_name(policy.dispatch_policy),
        policy=policy,
        migrate=policy.dispatch_policy.migrates,
        priorities=True,
        requeue_after_s=SHOAL_REQUEUE_AFTER_S if policy.dispatch_policy.moves_queued else None,
    )  # the live scheduler's default move of queued requests
    config = SimConfig(
        setup=setup, profile=profile, num_instances=run.num_instances,
        report_interval_s=report_interval_s, pairing_interval_s=pairing_interval_s,
    )  # fmt: skip
    simulator = Simulator(config, run.workload)
    result = simulator.run()
    return Outcome(
        policy.dispatch_policy.value,
        _simulated_latency(simulator.records.values()),
        result.preemptions,
        result.migrations,
    )


def forward_what_if(
    log: RecordedLog,
    what_if: DispatchPolicy,
    *,
    since: float | None = None,
    until: float | None = None,
    report_interval_s: float = 0.1,
    pairing_interval_s: float = 0.5,
) -> WhatIfReport:
    """Calibrate on the recorded policy, validate against the recording, predict under ``what_if``."""
    run = recorded_run(log, since=since, until=until)
    base = profile_for(run.instance)
    options = {"report_interval_s": report_interval_s, "pairing_interval_s": pairing_interval_s}
    # the factor: the simulated TPOT grows with the step times, but not in proportion (queues and
    # batches grow with them), so bracket the recorded median and bisect
    measured = run.recorded.latency.tpot_p50
    factor, profile = 1.0, base
    same = simulate_run(run, run.policy, profile, **options)
    if measured > 0 and same.latency.tpot_p50 > 0:
        tried = [(factor, same)]
        lo = hi = factor
        step = 2.0 if same.latency.tpot_p50 < measured else 0.5
        for _ in range(CALIBRATION_ROUNDS):  # bracket
            f = tried[-1][0] * step
            tried.append((f, simulate_run(run, run.policy, scaled(base, f), **options)))
            if (tried[-1][1].latency.tpot_p50 < measured) != (tried[-2][1].latency.tpot_p50 < measured):
                lo, hi = sorted((tried[-2][0], tried[-1][0]))
                break
        for _ in range(CALIBRATION_ROUNDS if lo < hi else 0):  # bisect
            f = (lo + hi) / 2
            outcome = simulate_run(run, run.policy, scaled(base, f), **options)
            tried.append((f, outcome))
            if abs(outcome.latency.tpot_p50 - measured) <= CALIBRATION_TOLERANCE * measured:
                break
            lo, hi = (f, hi) if outcome.latency.tpot_p50 < measured else (lo, f)
        factor, same = min(tried, key=lambda item: abs(item[1].latency.tpot_p50 - measured))
        profile = scaled(base, factor)
    other = simulate_run(run, dataclasses.replace(run.policy, dispatch_policy=what_if), profile, **options)
    errors = {}
    for name in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p50", "e2e_p99"):
        recorded = getattr(run.recorded.latency, name)
        if recorded > 0:
            errors[name] = (getattr(same.latency, name) - recorded) / recorded
    return WhatIfReport(
        run_start=run.start,
        run_end=run.end,
        num_requests=len(run.workload.requests),
        num_instances=run.num_instances,
        profile=base.name,
        time_scale=factor,
        recorded=run.recorded,
        simulated_recorded=same,
        simulated_what_if=other,
        errors=errors,
    )
