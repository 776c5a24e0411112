"""A request's (or one migration's) life from the event log as a Jaeger trace: ``shoal trace``.

:func:`jaeger_trace` turns a request's timeline
(:func:`scheduler.timeline.request_timeline`: its lifecycle events, the
scheduler's dispatch decision) and its migrations (the handshakes under
``<prefix>.ev.mig.<id>``, summarised by :func:`scheduler.replay.replay_log`)
into one trace in the JSON format Jaeger UI's "upload JSON" reads:
``{"data": [{"traceID", "spans", "processes"}]}``, with a ``request`` span
(frontend) as the root, a ``dispatch`` span (scheduler), one ``generate`` span
per instance the request ran on (placement, rescue or migration), and each
migration's span with a ``migration.stage`` child per stage on the source.
Times are microseconds since the epoch, as Jaeger wants. Ids are derived from
the request id, so exporting twice gives the same trace. Pure apart from the
in-memory log: reading NATS or a file and printing live in
:mod:`scheduler.trace_cli`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Protocol

from scheduler.logfile import RecordedLog
from scheduler.replay import MigrationSummary, replay_log
from schemas.envelope import Codec
from schemas.migration import MigrationMessage

__all__ = ["Step", "jaeger_trace", "migration_trace", "request_migrations"]

_US = 1_000_000


class Step(Protocol):
    """What :func:`jaeger_trace` reads of a step (a ``scheduler.timeline.TimelineStep``)."""

    @property
    def time(self) -> float: ...

    @property
    def kind(self) -> str: ...

    @property
    def instance_id(self) -> str: ...

    @property
    def detail(self) -> dict[str, Any]: ...


def request_migrations(log: RecordedLog, request_id: str | None = None) -> list[MigrationSummary]:
    """The migrations in ``log`` (of ``request_id`` only, if given), as the replay summarises them."""
    migrations = replay_log(log).migrations
    return [m for m in migrations if request_id is None or m.request_id == request_id]


def handshake_times(log: RecordedLog, migration_id: str) -> list[tuple[float, str]]:
    """(stored time, message type) of each handshake message of ``migration_id``."""
    codec = Codec()
    prefix = f"{log.subjects.prefix}.ev.mig."
    found = []
    for entry in log.events:
        if not entry.subject.startswith(prefix):
            continue
        envelope = codec.decode_or_none(entry.data)
        body = None if envelope is None else envelope.body
        if isinstance(body, MigrationMessage) and body.migration_id == migration_id:
            found.append((entry.time, type(body).__name__))
    return found


# -- Jaeger's JSON ----------------------------------------------------------------------------


def _id(seed: str, length: int) -> str:
    return hashlib.sha256(seed.encode()).hexdigest()[:length]


def _tags(values: dict[str, Any]) -> list[dict[str, Any]]:
    tags = []
    for key, value in sorted(values.items()):
        if value is None:
            continue
        if isinstance(value, bool):
            tags.append({"key": key, "type": "bool", "value": value})
        elif isinstance(value, int):
            tags.append({"key": key, "type": "int64", "value": value})
        elif isinstance(value, float):
            tags.append({"key": key, "type": "float64", "value": value})
        else:
            tags.append({"key": key, "type": "string", "value": str(value)})
    return tags


class _Builder:
    def __init__(self, trace_seed: str) -> None:
        self.trace_id = _id(trace_seed, 32)
        self.spans: list[dict[str, Any]] = []
        self.processes: dict[str, dict[str, Any]] = {}

    def process(self, service: str) -> str:
        """The process of ``service``, ``name`` or ``name/instance`` (``service.instance.id``)."""
        name, _, instance = service.partition("/")
        tags = _tags({"service.instance.id": instance}) if instance else []
        for process_id, process in self.processes.items():
            if process["serviceName"] == name and process["tags"] == tags:
                return process_id
        process_id = f"p{len(self.processes) + 1}"
        self.processes[process_id] = {"serviceName": name, "tags": tags}
        return process_id

    def span(
        self,
        name: str,
        service: str,
        start: float,
        end: float,
        *,
        parent: str | None,
        tags: dict[str, Any],
        logs: Sequence[tuple[float, str]] = (),
    ) -> str:
        span_id = _id(f"{self.trace_id}/{len(self.spans)}/{name}", 16)
        start_us = int(start * _US)
        self.spans.append({
            "traceID": self.trace_id,
            "spanID": span_id,
            "operationName": name,
            "references": [] if parent is None else [
                {"refType": "CHILD_OF", "traceID": self.trace_id, "spanID": parent}
            ],
            "startTime": start_us,
            "duration": max(0, int(end * _US) - start_us),
            "tags": _tags(tags),
            "logs": [
                {"timestamp": int(at * _US), "fields": [{"key": "event", "type": "string", "value": what}]}
                for at, what in logs
            ],
            "processID": self.process(service),
            "warnings": None,
        })
        return span_id

    def trace(self) -> dict[str, Any]:
        return {"data": [{"traceID": self.trace_id, "spans": self.spans, "processes": self.processes}]}


def _agent(instance_id: str) -> str:
    return f"shoal-agent/{instance_id}"


def _migration_spans(
    builder: _Builder,
    migration: MigrationSummary,
    parent: str | None,
    handshake: Sequence[tuple[float, str]] = (),
) -> str:
    end = migration.ended_at or migration.started_at
    downtime = migration.downtime_s
    span_id = builder.span(
        "migration", _agent(migration.source_id), migration.started_at, end, parent=parent,
        tags={
            "shoal.migration.id": migration.migration_id,
            "shoal.request.id": migration.request_id,
            "shoal.migration.source": migration.source_id,
            "shoal.migration.destination": migration.destination_id,
            "shoal.migration.outcome": migration.outcome,
            "shoal.migration.downtime_ms": None if downtime is None else downtime * 1e3,
            "shoal.migration.stages": len(migration.stages),
        },
        logs=handshake,
    )
    at = migration.started_at
    for stage in migration.stages:
        builder.span(
            "migration.stage", _agent(migration.source_id), at, at + stage.duration_s, parent=span_id,
            tags={"shoal.migration.stage": stage.stage, "shoal.migration.blocks": stage.num_blocks},
        )
        at += stage.duration_s
    return span_id


def jaeger_trace(
    request_id: str, steps: Sequence[Step], migrations: Sequence[MigrationSummary] = ()
) -> dict[str, Any]:
    """The request's trace in Jaeger UI's upload format (see the module docstring)."""
    builder = _Builder(f"request/{request_id}")
    if not steps:
        return builder.trace()
    start = min(step.time for step in steps)
    end = max([step.time for step in steps] + [m.ended_at for m in migrations])
    outcome: dict[str, Any] = {}
    for step in steps:
        if step.kind == "finished":
            outcome = {"shoal.finish_reason": step.detail.get("finish_reason"),
                       "shoal.num_output_tokens": step.detail.get("num_output_tokens")}
        elif step.kind == "aborted":
            outcome = {"shoal.abort_reason": step.detail.get("reason"), "error": True}
    logs = [(step.time, step.kind) for step in steps if step.kind in ("arrived", "first_token", "rescued",
                                                                         "finished", "aborted")]
    root = builder.span("request", "shoal-frontend", start, end, parent=None,
                        tags={"shoal.request.id": request_id, **outcome}, logs=logs)
    for step in steps:
        if step.kind == "dispatched":
            placed = [s.time for s in steps if s.kind == "placed" and s.time >= step.time]
            builder.span("dispatch", "shoal-scheduler", step.time, placed[0] if placed else step.time,
                         parent=root, tags={"shoal.dispatch.instance": step.instance_id,
                                            "shoal.dispatch.policy": step.detail.get("policy"),
                                            "shoal.scheduler.epoch": step.detail.get("epoch")})
    # residencies: placement, then each rescue and committed migration moves the request
    moves: list[tuple[float, str, dict[str, Any]]] = []
    for step in steps:
        if step.kind == "placed":
            moves.append((step.time, step.instance_id, {"shoal.placement.bypass": step.detail.get("bypass")}))
        elif step.kind == "rescued":
            failed = step.detail.get("failed_instance_id")
            moves.append((step.time, step.instance_id, {"shoal.rescue": True, "shoal.rescued_from": failed}))
    for migration in migrations:
        if migration.outcome == "committed":
            source = {"shoal.migrated_from": migration.source_id}
            moves.append((migration.ended_at, migration.destination_id, source))
    moves.sort(key=lambda move: move[0])
    residency_ids: list[tuple[float, float, str, str]] = []
    for index, (at, instance_id, tags) in enumerate(moves):
        until = moves[index + 1][0] if index + 1 < len(moves) else end
        first = [s.time for s in steps if s.kind == "first_token" and s.instance_id == instance_id
                 and at <= s.time <= until]
        span_id = builder.span("generate", _agent(instance_id), at, until, parent=root,
                               tags={"shoal.instance": instance_id, **tags},
                               logs=[(first[0], "first_token")] if first else [])
        residency_ids.append((at, until, instance_id, span_id))
    for migration in migrations:
        parent = root
        for at, until, instance_id, span_id in residency_ids:
            if instance_id == migration.source_id and at <= migration.started_at <= until:
                parent = span_id
        _migration_spans(builder, migration, parent)
    return builder.trace()


def migration_trace(
    migration: MigrationSummary, handshake: Sequence[tuple[float, str]] = ()
) -> dict[str, Any]:
    """One migration alone as a trace: its span, a child per stage, the handshake as its logs."""
    builder = _Builder(f"migration/{migration.migration_id}")
    _migration_spans(builder, migration, None, handshake)
    return builder.trace()
