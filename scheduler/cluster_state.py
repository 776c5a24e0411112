"""The scheduler's view of the cluster: immutable state built by folding the event log.

:class:`ClusterState` holds what the fold (:mod:`scheduler.fold`) learned: the
instances (active, terminating, failed; departed ones are dropped) with their
latest load view and the dispatches not yet reflected in it, the pairs in
force, the lease epoch, the migrations in flight, who owns the requests that
moved, the last position folded per stream, and counters. Every part is a
frozen ``msgspec`` struct or a dict treated as immutable (an update copies the
dict it changes), so a state is cheap to keep, compare and snapshot
(:func:`encode_snapshot` / :func:`decode_snapshot`). No I/O here.
"""

from __future__ import annotations

import enum

import msgspec

from scheduler.policy.load import InstanceLoad
from scheduler.policy.pairing import Pairing
from schemas.instance import InstanceJoined

__all__ = [
    "ClusterState",
    "InstanceRecord",
    "InstanceStatus",
    "MigrationPhase",
    "MigrationRecord",
    "PendingDispatch",
    "RequestOwner",
    "decode_snapshot",
    "encode_snapshot",
    "initial_state",
    "live_loads",
    "owner_of",
]


class InstanceStatus(enum.StrEnum):
    ACTIVE = "active"
    TERMINATING = "terminating"
    FAILED = "failed"


class PendingDispatch(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A dispatch the instance's load reports do not reflect yet.

    ``reports_seen`` counts the reports folded since; after the state's
    ``pending_report_limit`` reports the dispatch is taken as lost (the request
    never reached the agent) and stops counting against the instance.
    """

    request_id: str
    num_blocks: int
    reports_seen: int = 0


class InstanceRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One instance: how it joined, its status, its load view and pending dispatches.

    ``incarnation`` is the events-stream sequence of the ``InstanceJoined`` that began this
    record (0 in snapshots that predate it): an agent that joins again under the same id (it
    restarted) is a new incarnation, ``rejoined``, with nothing of the old one's.
    """

    joined: InstanceJoined
    status: InstanceStatus
    load: InstanceLoad
    pending: tuple[PendingDispatch, ...] = ()
    last_heartbeat_seq: int = 0
    incarnation: int = 0
    rejoined: bool = False

    @property
    def instance_id(self) -> str:
        return self.joined.instance_id


class MigrationPhase(enum.StrEnum):
    PRE_ALLOCATING = "pre_allocating"
    COPYING = "copying"
    COMMITTING = "committing"


class MigrationRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A migration in flight, as far as its logged handshake steps tell."""

    migration_id: str
    request_id: str
    source_id: str
    destination_id: str
    stage: int
    phase: MigrationPhase
    num_blocks_copied: int = 0


class RequestOwner(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Who runs a request that moved (migration committed, or rescued), until it finishes."""

    request_id: str
    instance_id: str
    owner_epoch: int
    migration_id: str = ""


class ClusterState(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the fold knows. Build the first one with :func:`initial_state`.

    ``positions`` maps a stream name to the last sequence folded from it;
    streams in ``gapless_streams`` must be folded without a missing sequence.
    """

    positions: dict[str, int] = msgspec.field(default_factory=dict)
    gapless_streams: frozenset[str] = frozenset()
    pending_report_limit: int = 3
    epoch: int = 0
    instances: dict[str, InstanceRecord] = msgspec.field(default_factory=dict)
    pairings: dict[str, Pairing] = msgspec.field(default_factory=dict)
    migrations: dict[str, MigrationRecord] = msgspec.field(default_factory=dict)
    owners: dict[str, RequestOwner] = msgspec.field(default_factory=dict)
    num_launching: int = 0
    num_events: int = 0
    num_dispatched: int = 0
    num_stale_decisions: int = 0
    num_ignored: int = 0
    num_migrations_committed: int = 0
    num_migrations_aborted: int = 0
    num_requests_arrived: int = 0
    num_requests_finished: int = 0


def initial_state(
    *,
    gapless_streams: tuple[str, ...] | frozenset[str] = (),
    start_positions: dict[str, int] | None = None,
    pending_report_limit: int = 3,
) -> ClusterState:
    """An empty state. ``start_positions`` lets a fold begin after a stream's first sequences.

    Name the events stream in ``gapless_streams``; leave the loads stream out
    (its retention drops old reports, so it has gaps by design).
    """
    if pending_report_limit < 1:
        raise ValueError("pending_report_limit must be >= 1")
    return ClusterState(
        positions=dict(start_positions or {}),
        gapless_streams=frozenset(gapless_streams),
        pending_report_limit=pending_report_limit,
    )


#: ``(instance ids in a dict's order, the same sorted)`` of the last :func:`live_loads` call: a
#: state's instances keep their order from one fold to the next until one joins or leaves.
_id_order: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())


def live_loads(state: ClusterState) -> list[InstanceLoad]:
    """Load views of active and terminating instances, in instance-id order (policy input)."""
    global _id_order
    instances = state.instances
    ids = tuple(instances)
    if ids != _id_order[0]:
        _id_order = (ids, tuple(sorted(ids)))
    failed = InstanceStatus.FAILED
    return [record.load for key in _id_order[1] if (record := instances[key]).status is not failed]


def owner_of(state: ClusterState, request_id: str) -> RequestOwner | None:
    """Where a moved request runs now; None if it never moved (it is where it was placed)."""
    return state.owners.get(request_id)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ClusterState)


def encode_snapshot(state: ClusterState) -> bytes:
    """The state as msgpack bytes (positions included), for a snapshot store."""
    return _encoder.encode(state)


def decode_snapshot(data: bytes) -> ClusterState:
    return _decoder.decode(data)
