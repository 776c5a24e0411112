"""The frozen configuration of one agent, and its fault-injection plan.

:class:`AgentConfig` is built once at the entry point (``shoal agent`` or a
test) and passed down; nothing below reads the environment. :class:`FaultPlan`
is the test hook on the agent's migration messages: it drops or duplicates
outgoing or incoming handshake messages by type name (``"PreAllocate"``,
``"Ack"``, ``"Abort"``, ``"StageDone"``, ``"Commit"``, ``"CommitAck"``), can
slow every stage copy down or hold it until the test releases it, so that
something can happen in the middle of one, and can pace the engine's steps so
that a test's request cannot finish before the test has acted on it, however
fast the engine is. ``first_step`` makes the engine's first step fail, which is
the warm-up step every agent runs before it announces itself
(:class:`FirstStepFault`): drills and tests of an engine that cannot compute.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from agents.cache_events import CacheEventsConfig
from agents.migration.fsm.config import MigrationConfig
from scheduler.config import PolicyConfig
from transport import TransportConfig

__all__ = [
    "MIGRATION_MESSAGE_TYPES", "AgentConfig", "FaultPlan", "FirstStepFault", "InjectedStepFault", "StepPace",
]

#: Names a :class:`FaultPlan` may use.
MIGRATION_MESSAGE_TYPES = frozenset({"PreAllocate", "Ack", "Abort", "StageDone", "Commit", "CommitAck"})


@dataclass
class StepPace:
    """A test's hold on an agent's speed: each engine step lasts at least ``min_step_s``.

    The step loop pauses for the rest of a step that took less (the event loop runs
    meanwhile), so a request of ``n`` more tokens lasts at least ``n * min_step_s``
    however fast the engine is, and a test can act on it before it finishes;
    :meth:`release` lets the engine run at its own speed again.
    """

    min_step_s: float

    def __post_init__(self) -> None:
        if self.min_step_s < 0:
            raise ValueError("min_step_s must be >= 0")

    def release(self) -> None:
        self.min_step_s = 0.0


class FirstStepFault(enum.StrEnum):
    """What the engine's first step (the agent's warm-up step) does instead of computing.

    * ``RAISE``: the step raises :class:`InjectedStepFault`, as an engine whose kernel
      reports an error would; the agent never announces itself and ``shoal agent`` exits 1.
    * ``EXIT``: the process dies of ``SIGILL`` (core dumps off), as an engine whose
      kernel uses an instruction the CPU or the kernel refuses does (exit status -4,
      shell status 132); nothing runs after it, no goodbye is sent.
    """

    RAISE = "raise"
    EXIT = "exit"


class InjectedStepFault(RuntimeError):
    """The engine step a :class:`FaultPlan`'s ``first_step`` made fail."""


@dataclass(frozen=True)
class FaultPlan:
    """Which migration messages to lose or repeat, on the way out or in.

    ``max_faults`` bounds how many messages of each (direction, kind, type) are
    affected (``None``: every one). ``copy_delay_s`` sleeps before each stage's
    transfer on the source, so a test can act while a copy is under way;
    ``copy_gate`` (in-process tests only) holds each stage's transfer until the
    event is set, bounded by the copy timeout. ``pace`` holds the engine's speed
    down while the test acts (see :class:`StepPace`). ``first_step``: what the
    engine's first step does instead of computing (see :class:`FirstStepFault`).
    """

    drop_outgoing: frozenset[str] = frozenset()
    duplicate_outgoing: frozenset[str] = frozenset()
    drop_incoming: frozenset[str] = frozenset()
    duplicate_incoming: frozenset[str] = frozenset()
    max_faults: int | None = None
    copy_delay_s: float = 0.0
    copy_gate: asyncio.Event | None = field(default=None, compare=False)
    pace: StepPace | None = field(default=None, compare=False)
    first_step: FirstStepFault | None = None

    def __post_init__(self) -> None:
        for names in (
            self.drop_outgoing,
            self.duplicate_outgoing,
            self.drop_incoming,
            self.duplicate_incoming,
        ):
            unknown = set(names) - MIGRATION_MESSAGE_TYPES
            if unknown:
                raise ValueError(f"unknown migration message types {sorted(unknown)}")
        if self.copy_delay_s < 0:
            raise ValueError("copy_delay_s must be >= 0")

    @property
    def is_empty(self) -> bool:
        return not (
            self.drop_outgoing
            or self.duplicate_outgoing
            or self.drop_incoming
            or self.duplicate_incoming
            or self.copy_delay_s
            or self.copy_gate is not None
            or self.pace is not None
            or self.first_step is not None
        )


@dataclass(frozen=True)
class AgentConfig:
    """Everything one agent needs besides its engine and its bus connection.

    * ``report_interval_s``: a load report when something changed, at most this often;
      ``heartbeat_interval_s``: a report at least this often (reports are the heartbeat);
      ``gradual_report_interval_s``: when only block counts changed (requests decoding, see
      :func:`agents.reporting.urgent_signature`), a report at most this often.
    * ``delta_buffer_steps``: token deltas kept per request for ``resend``;
      ``finished_buffers``: how many finished requests keep their buffer.
    * ``tick_interval_s``: how often migration machines see the clock.
    * ``idle_sleep_s``: the step loop's pause after a step that scheduled nothing.
    * ``peer_lookup_timeout_s``: how long to wait for a destination's ``InstanceJoined``.
    * ``orphan_check_interval_s``: how often each live request's token subject is probed for a
      listener (0: never); a request nobody listens to in two probes in a row — its frontend is
      gone — is aborted, so it ends within about twice this (plus ``orphan_probe_timeout_s``).
    * ``warm_up_timeout_s``: how long the warm-up request (:meth:`agents.service.Agent.start`) may
      take before the agent gives up starting (a first step may compile kernels).
    * ``cache_events``: how the prefix cache's batches are appended (timeouts, tries, pacing).
    """

    instance_id: str
    report_interval_s: float = 0.1
    heartbeat_interval_s: float = 1.0
    gradual_report_interval_s: float = 0.3
    delta_buffer_steps: int = 256
    finished_buffers: int = 1024
    tick_interval_s: float = 0.05
    idle_sleep_s: float = 0.002
    peer_lookup_timeout_s: float = 2.0
    orphan_check_interval_s: float = 2.0
    orphan_probe_timeout_s: float = 0.5
    warm_up_timeout_s: float = 300.0
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    transport: TransportConfig = field(default_factory=lambda: TransportConfig(kind="tcp"))
    faults: FaultPlan = field(default_factory=FaultPlan)
    cache_events: CacheEventsConfig = field(default_factory=CacheEventsConfig)

    def __post_init__(self) -> None:
        if not self.instance_id or any(c in self.instance_id for c in ".*> \t\r\n"):
            raise ValueError(f"invalid instance id {self.instance_id!r}")
        for name in (
            "report_interval_s",
            "heartbeat_interval_s",
            "gradual_report_interval_s",
            "tick_interval_s",
            "peer_lookup_timeout_s",
            "warm_up_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.orphan_check_interval_s < 0 or self.orphan_probe_timeout_s <= 0:
            raise ValueError("orphan_check_interval_s must be >= 0 and orphan_probe_timeout_s positive")
        if self.delta_buffer_steps < 1 or self.finished_buffers < 0:
            raise ValueError("delta_buffer_steps must be >= 1 and finished_buffers >= 0")
