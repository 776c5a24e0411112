"""One request's life from the log: ``shoal replay --request``.

:func:`request_timeline` collects, in log order, what the log holds about a
request: its arrival, the dispatch decision (the instance chosen, the policy,
every live instance's load and freeness as the decision saw them, from the
state folded at the decision's fold point, and the runner-up), its placement
(bypass or not), first token, each migration with its handshake steps, stage
timings and downtime, rescues, and its finish or abort with the reason.

Agents log when their engine admits a request (how long it queued) and each
preemption of it (``RequestAdmitted``, ``RequestPreempted``), and why each
migration started (``MigrationStarted``: the pairing command, a drain, or a
direct request); the frontend logs why it bypassed the scheduler
(``RequestPlaced.bypass_reason``). Logs written before those events existed
fall back on the instances' cumulative ``num_preemptions`` in their load
reports: how many preemptions each instance counted while the request was on
it (an upper bound, not the request's own). Pure apart from reading the in-memory log; rendering lives in
:mod:`scheduler.replay_cli`.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from scheduler.config import PolicyConfig
from scheduler.logfile import RecordedLog
from scheduler.replay import Candidate, MigrationSummary, ReplayOptions, replay_log
from schemas.decisions import Dispatched
from schemas.envelope import Codec
from schemas.load import LoadReport
from schemas.migration import Commit, CommitAck, MigrationMessage, MigrationStarted, PreAllocate
from schemas.requests import (
    RequestAborted,
    RequestAdmitted,
    RequestArrived,
    RequestEvent,
    RequestFinished,
    RequestFirstToken,
    RequestPlaced,
    RequestPreempted,
    RequestRescued,
)

__all__ = ["RequestTimeline", "ResidencyPreemptions", "TimelineStep", "request_timeline"]


class TimelineStep(msgspec.Struct, frozen=True):
    """One thing that happened to the request. ``kind`` is ``arrived``, ``dispatched``, ``placed``,
    ``admitted``, ``first_token``, ``preempted``, ``migration``, ``rescued``, ``finished`` or
    ``aborted``; ``time`` is when the server stored it, ``event_time`` when its producer stamped it."""

    seq: int
    time: float
    event_time: float
    kind: str
    instance_id: str
    detail: dict[str, Any]


class ResidencyPreemptions(msgspec.Struct, frozen=True):
    """Preemptions an instance counted (all its requests) while this request was on it."""

    instance_id: str
    start: float
    end: float
    num_preemptions: int


class RequestTimeline(msgspec.Struct):
    request_id: str
    steps: list[TimelineStep]
    migrations: list[MigrationSummary]
    preemptions: list[ResidencyPreemptions]
    #: What the log cannot tell about this request (shown to the user as-is).
    notes: list[str] = msgspec.field(default_factory=list)

    @property
    def found(self) -> bool:
        return bool(self.steps)


def _dispatch_detail(body: Dispatched, view: list[Candidate] | None) -> dict[str, Any]:
    detail: dict[str, Any] = {
        "policy": body.policy,
        "epoch": body.epoch,
        "num_prompt_tokens": body.num_prompt_tokens,
        "priority": body.priority,
        "fold_point": {"events_seq": body.events_seq, "loads_seq": body.loads_seq},
        "exclude": list(body.exclude),
    }
    if body.requeued_from:
        detail["requeued_from"] = body.requeued_from
    if body.num_chain_blocks:  # what the prefix index said: per instance, leading blocks held
        detail["prefix"] = {
            "num_chain_blocks": body.num_chain_blocks, "cached_blocks": dict(body.cached_blocks),
            "kv_seq": body.kv_seq,
        }
    if view is None:
        return detail
    after = body.policy == "freeness_after_admit"
    scored = any(c.score is not None for c in view)

    def rank(c: Candidate) -> tuple[bool, float, str]:
        if scored:  # the decision's own policy judged each instance: rank as it did
            return (c.excluded, math.inf if c.score is None else -c.score, c.instance_id)
        return (c.excluded, -(c.freeness_after if after else c.freeness), c.instance_id)

    ranked = sorted(view, key=rank)
    chosen = [c for c in ranked if c.instance_id == body.instance_id]
    detail["candidates"] = [msgspec.to_builtins(c) for c in chosen + [c for c in ranked if c not in chosen]]
    others = [c for c in ranked if c.instance_id != body.instance_id and not c.excluded]
    detail["runner_up"] = others[0].instance_id if others else None
    return detail


def _migration_step(message: MigrationMessage, time: float, subject: str) -> dict[str, Any]:
    step: dict[str, Any] = msgspec.to_builtins(message)
    step.pop("token_ids", None)
    step.pop("block_ids", None)
    step["time"] = time
    #: The conditional append on ``<mig>.outcome`` that decided the migration (first claim wins).
    step["outcome_claim"] = subject.endswith(".outcome")
    return step


def _residencies(steps: list[TimelineStep], end: float) -> list[tuple[str, float, float]]:
    """(instance, from, to) the request ran on, from placement, migrations and rescues."""
    spans: list[tuple[str, float]] = []
    for step in steps:
        if step.kind == "placed" or step.kind == "rescued":
            spans.append((step.instance_id, step.time))
        elif step.kind == "migration" and step.detail.get("outcome") == "committed":
            spans.append((step.detail["destination_id"], step.detail["ended_at"]))
    if not spans:
        return []
    bounds = [t for _, t in spans[1:]] + [end]
    return [(instance, start, stop) for (instance, start), stop in zip(spans, bounds, strict=True)]


def _preemptions(
    log: RecordedLog, codec: Codec, spans: list[tuple[str, float, float]]
) -> list[ResidencyPreemptions]:
    wanted = {instance for instance, _, _ in spans}
    reports: dict[str, list[tuple[float, int]]] = {}
    for entry in log.loads:
        instance = entry.subject.rsplit(".", 1)[-1]
        if instance not in wanted:
            continue
        envelope = codec.decode_or_none(entry.data)
        if envelope is not None and isinstance(envelope.body, LoadReport):
            reports.setdefault(instance, []).append((entry.time, envelope.body.num_preemptions))
    out = []
    for instance, start, stop in spans:
        inside = [n for t, n in reports.get(instance, []) if start <= t <= stop]
        before = [n for t, n in reports.get(instance, []) if t < start]
        base = before[-1] if before else (inside[0] if inside else 0)
        out.append(ResidencyPreemptions(instance, start, stop, max(inside, default=base) - base))
    return out


def request_timeline(
    log: RecordedLog, request_id: str, *, policy: PolicyConfig | None = None
) -> RequestTimeline:
    """Everything ``log`` says about ``request_id``, in log order (see the module docstring)."""
    options = ReplayOptions(capture_requests=frozenset({request_id}), policy=policy or PolicyConfig())
    result = replay_log(log, options)
    codec = Codec()
    subjects = log.subjects
    own_subject = subjects.req(request_id)
    dispatch_subject = subjects.sched("dispatch")
    mig_prefix = f"{subjects.prefix}.ev.mig."
    steps: list[TimelineStep] = []
    migrations: dict[str, list[dict[str, Any]]] = {}
    first_seen: dict[str, tuple[int, float, float]] = {}
    started: dict[str, MigrationStarted] = {}
    for entry in log.events:
        if (
            entry.subject != own_subject
            and entry.subject != dispatch_subject
            and not entry.subject.startswith(mig_prefix)
        ):
            continue
        envelope = codec.decode_or_none(entry.data)
        if envelope is None:
            continue
        body = envelope.body
        at = (entry.seq, entry.time, envelope.time)
        if isinstance(body, RequestEvent):
            steps.append(_request_step(at, body))
        elif isinstance(body, Dispatched) and body.request_id == request_id:
            view = result.dispatch_views.get(entry.seq)
            kind = "requeued" if body.requeued_from else "dispatched"  # moved off a stalled queue
            steps.append(TimelineStep(*at, kind, body.instance_id, _dispatch_detail(body, view)))
        elif isinstance(body, MigrationStarted) and body.request_id == request_id:
            first_seen.setdefault(body.migration_id, at)
            started[body.migration_id] = body
            migrations.setdefault(body.migration_id, [])
        elif isinstance(body, (PreAllocate, Commit, CommitAck)) and body.request_id == request_id:
            first_seen.setdefault(body.migration_id, at)
            migrations.setdefault(body.migration_id, []).append(
                _migration_step(body, entry.time, entry.subject)
            )
        elif isinstance(body, MigrationMessage) and body.migration_id in migrations:
            migrations[body.migration_id].append(_migration_step(body, entry.time, entry.subject))
    summaries = {m.migration_id: m for m in result.migrations if m.request_id == request_id}
    for migration_id, handshake in migrations.items():
        summary = summaries.get(migration_id)
        detail: dict[str, Any] = {"migration_id": migration_id, "handshake": handshake}
        if summary is not None:
            detail.update(msgspec.to_builtins(summary))
        why = started.get(migration_id)
        if why is not None:
            detail["cause"] = {
                "cause": why.cause.value,
                "epoch": why.epoch,
                "target_freeness": why.target_freeness,
                "source_freeness": why.source_freeness,
            }
            detail.setdefault("source_id", why.source_id)
            detail.setdefault("destination_id", why.destination_id)
        source = summary.source_id if summary is not None else ""
        steps.append(TimelineStep(*first_seen[migration_id], "migration", source, detail))
    steps.sort(key=lambda step: step.seq)
    ends = [step.time for step in steps if step.kind in ("finished", "aborted")]
    end = ends[-1] if ends else max((e.time for e in log.events), default=0.0)
    notes = []
    if not any(step.kind == "admitted" for step in steps):
        notes.append(
            "admission and preemptions are not logged per request in this log (older agents): the "
            "preemption counts are every preemption of the instance while the request was on it "
            "(from its load reports' cumulative num_preemptions)"
        )
    if steps and not any(step.kind == "arrived" for step in steps):
        notes.append(
            "no arrival logged: the frontend's request events are missing (not exported, or aged out)"
        )
    preemptions = _preemptions(log, codec, _residencies(steps, end))
    return RequestTimeline(
        request_id, steps, [summaries[m] for m in migrations if m in summaries], preemptions, notes
    )


def _request_step(at: tuple[int, float, float], body: RequestEvent) -> TimelineStep:
    detail = msgspec.to_builtins(body)
    detail.pop("type", None)
    detail.pop("request_id", None)
    if isinstance(body, RequestArrived):
        return TimelineStep(*at, "arrived", "", detail)
    if isinstance(body, RequestPlaced):
        return TimelineStep(*at, "placed", body.instance_id, detail)
    if isinstance(body, RequestFirstToken):
        return TimelineStep(*at, "first_token", body.instance_id, detail)
    if isinstance(body, RequestAdmitted):
        return TimelineStep(*at, "admitted", body.instance_id, detail)
    if isinstance(body, RequestPreempted):
        return TimelineStep(*at, "preempted", body.instance_id, detail)
    if isinstance(body, RequestRescued):
        return TimelineStep(*at, "rescued", body.new_instance_id, detail)
    if isinstance(body, RequestFinished):
        return TimelineStep(*at, "finished", "", detail)
    assert isinstance(body, RequestAborted)
    return TimelineStep(*at, "aborted", "", detail)
