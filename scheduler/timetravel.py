"""Time travel through a recorded log: the cluster at an instant, and what changed between two.

:func:`state_at` rebuilds the scheduler's state at a time (from the last
checkpoint before it when the log has one, see :mod:`scheduler.replay`);
:func:`cluster_view` reduces a state to what a person compares (each
instance's status, running and waiting requests, used blocks, pending
dispatches, preemptions and freeness under the recorded policy; the
pairings); :func:`changes` lists what differs between two views. ``shoal
replay --at-time T --step S`` prints them (:mod:`scheduler.replay_cli`). Pure
apart from reading the in-memory log.
"""

from __future__ import annotations

import math

import msgspec

from scheduler.cluster_state import ClusterState
from scheduler.config import PolicyConfig
from scheduler.logfile import RecordedLog
from scheduler.policy.load import load_freeness
from scheduler.replay import ReplayOptions, replay_log

__all__ = ["Change", "ClusterView", "InstanceView", "changes", "cluster_view", "state_at"]


class InstanceView(msgspec.Struct, frozen=True):
    instance_id: str
    status: str
    running: int
    waiting: int
    used_blocks: int
    total_blocks: int
    pending: int
    preemptions: int
    freeness: float | None  # None: minus infinity (a terminating instance)


class ClusterView(msgspec.Struct, frozen=True):
    time: float
    events_seq: int
    loads_seq: int
    instances: dict[str, InstanceView]
    #: source -> destination
    pairings: dict[str, str]


class Change(msgspec.Struct, frozen=True):
    """One difference: ``subject`` (an instance id or ``pairing <source>``), what, before and after."""

    subject: str
    field: str
    before: str
    after: str


def state_at(
    log: RecordedLog, at: float, policy: PolicyConfig | None = None
) -> tuple[ClusterState, PolicyConfig]:
    """The folded state with everything stored up to ``at``, and the policy then in force."""
    options = ReplayOptions(until_time=at, from_time=at, policy=policy or PolicyConfig())
    result = replay_log(log, options)
    return result.state, result.policy


def cluster_view(state: ClusterState, policy: PolicyConfig, at: float) -> ClusterView:
    instances = {}
    for instance_id, record in sorted(state.instances.items()):
        load = record.load
        freeness = load_freeness(load, policy)
        instances[instance_id] = InstanceView(
            instance_id=instance_id,
            status=record.status.value,
            running=load.num_running,
            waiting=load.num_waiting,
            used_blocks=load.num_used_blocks,
            total_blocks=load.num_total_blocks,
            pending=load.num_pending,
            preemptions=load.num_preemptions,
            freeness=freeness if math.isfinite(freeness) else None,
        )
    events_seq = max(
        (seq for stream, seq in state.positions.items() if stream.endswith("_events")), default=0
    )
    loads_seq = max((seq for stream, seq in state.positions.items() if stream.endswith("_loads")), default=0)
    pairings = {p.source_id: p.destination_id for p in state.pairings.values()}
    return ClusterView(at, events_seq, loads_seq, instances, pairings)


def _text(value: object) -> str:
    if value is None:
        return "-inf"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


_FIELDS = ("status", "running", "waiting", "used_blocks", "pending", "preemptions", "freeness")


def changes(before: ClusterView, after: ClusterView) -> list[Change]:
    """What differs from ``before`` to ``after``: instances that came or went, changed fields, pairings."""
    out: list[Change] = []
    for instance_id in sorted(set(before.instances) | set(after.instances)):
        old, new = before.instances.get(instance_id), after.instances.get(instance_id)
        if old is None:
            assert new is not None
            out.append(Change(instance_id, "instance", "-", "joined"))
            out.extend(Change(instance_id, name, "-", _text(getattr(new, name))) for name in _FIELDS)
            continue
        if new is None:
            out.append(Change(instance_id, "instance", old.status, "left"))
            continue
        for name in _FIELDS:
            a, b = getattr(old, name), getattr(new, name)
            if name == "freeness" and a is not None and b is not None and round(a, 1) == round(b, 1):
                continue
            if a != b:
                out.append(Change(instance_id, name, _text(a), _text(b)))
    for source in sorted(set(before.pairings) | set(after.pairings)):
        a, b = before.pairings.get(source), after.pairings.get(source)
        if a != b:
            out.append(Change(f"pairing {source}", "destination", a or "-", b or "-"))
    return out
