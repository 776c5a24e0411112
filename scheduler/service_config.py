"""The scheduler service's frozen configuration, its roles and its counters.

Split from :mod:`scheduler.service` (which re-exports everything here); no I/O.
"""

from __future__ import annotations

import enum
import os
import socket
import uuid
from dataclasses import dataclass, field

import msgspec

from scheduler.config import PolicyConfig

__all__ = ["SENT_HEADER", "Role", "SchedulerConfig", "SchedulerStats", "default_scheduler_id"]

#: A requester may stamp a dispatch request with its send time (epoch seconds) for latency breakdowns.
SENT_HEADER = "Shoal-Sent"


class Role(enum.StrEnum):
    STARTING = "starting"
    STANDBY = "standby"
    TAKING_OVER = "taking_over"
    ACTIVE = "active"
    STOPPED = "stopped"


def default_scheduler_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler service behaves (seconds for times). Built at the entry point."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    scheduler_id: str = field(default_factory=default_scheduler_id)
    standby: bool = False
    pairing_interval_s: float = 0.5
    failure_timeout_s: float = 3.0
    #: Before an instance silent past ``failure_timeout_s`` is marked failed, the scheduler asks it
    #: directly (its ``liveness`` RPC, core NATS) and waits this long for an answer. An instance whose
    #: report loop is still sending is alive and only its load reports are late (say, the loads stream
    #: has no leader for a few seconds on a NATS cluster); one that does not answer, or answers that
    #: its reports stopped, is failed. 0: no probe (the silence alone decides).
    failure_probe_timeout_s: float = 1.0
    lease_ttl_s: float = 3.0
    snapshot_every_events: int = 20_000
    snapshot_every_s: float = 10.0
    use_snapshot: bool = True
    verify_shadow: bool = True
    pending_report_limit: int = 3
    command_timeout_s: float = 1.0
    max_in_flight_appends: int = 1024
    #: Keep the last 500k dispatch handling times in ``decision_times`` (benchmarks).
    record_decision_times: bool = False
    #: Long retention (``scheduler.history``): while active, copy the loads stream into the history
    #: stream every ``archive_interval_s`` and append a checkpoint of the state every
    #: ``checkpoint_every_s`` (with the first snapshot after a takeover, then at most this often).
    archive_loads: bool = True
    archive_interval_s: float = 1.0
    checkpoint_every_s: float = 300.0
    #: Move a queued request (no KV) off an instance whose head of line has waited this long, to
    #: where it would start at once (``scheduler.policy.dispatch.requeue_choice``); None: off.
    requeue_after_s: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "pairing_interval_s", "failure_timeout_s", "lease_ttl_s", "snapshot_every_s",
            "archive_interval_s", "checkpoint_every_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.failure_probe_timeout_s < 0:
            raise ValueError("failure_probe_timeout_s must be >= 0")
        if self.requeue_after_s is not None:
            if self.requeue_after_s <= 0:
                raise ValueError(f"requeue_after_s must be > 0 or None, got {self.requeue_after_s}")
            if not self.policy.dispatch_policy.moves_queued:
                raise ValueError(
                    "requeue_after_s moves queued requests with the blocks_ahead and prefill_ahead rules; "
                    f"the policy is {self.policy.dispatch_policy.value}"
                )
        if self.snapshot_every_events < 1:
            raise ValueError("snapshot_every_events must be >= 1")


class SchedulerStats(msgspec.Struct):
    dispatched: int = 0
    dispatch_errors: int = 0
    ticks: int = 0
    failures_detected: int = 0
    #: silent instances whose liveness probe said they still send reports (the reports were late, not they)
    failures_averted: int = 0
    commands_sent: int = 0
    command_errors: int = 0
    snapshots: int = 0
    checkpoints: int = 0
    takeovers: int = 0
    step_downs: int = 0
    #: times recovery or the service loop failed on the bus and started over
    bus_restarts: int = 0
    recovered_at: float = 0.0
    first_dispatch_at: float = 0.0
    #: queued requests the scheduler told an agent to move (``requeue_after_s``)
    requeues: int = 0
