"""The cluster-state fold: ``evolve(state, position, body) -> state`` and ``replay(events)``.

Every event type in :mod:`schemas` has a rule here:

* instance lifecycle: ``InstanceJoined`` (a new record; one launching instance
  arrived), ``InstanceHeartbeat``, ``InstanceTerminating``, ``InstanceFailed``
  (an older lease epoch is ignored, and so is the failure of an earlier
  incarnation), ``InstanceLeft`` (the record goes); pairs with a failed or
  departed instance end. An ``InstanceJoined`` under an id already known is a
  new incarnation (the agent restarted): nothing of the old one carries over —
  its pending dispatches, pairs, migrations in flight and the requests it owned
  are dropped (a rescue or their end settles those requests), and the new
  incarnation's first load report (agent ``seq`` 1) is taken even after the old
  one's later reports;
* ``LoadReport``: the instance's new view. Pending dispatches are reconciled by
  the accepted-request counter (the counter's increase since the previous
  report retires that many of the oldest pending dispatches); one that survives
  ``pending_report_limit`` reports is taken as lost. An out-of-order report
  (agent ``seq`` not newer) and reports of unknown or failed instances are ignored;
* decisions (``Dispatched``, ``Paired``, ``Unpaired``, ``ScaleUp``,
  ``ScaleDown``, ``SchedulerTick``): applied if their lease epoch is at least the current one (a
  newer epoch becomes current), ignored and counted as stale otherwise;
* migration steps: a record per migration from its stage-0 ``PreAllocate`` to
  its outcome. The destination's ``CommitAck`` in the log decides the owner of
  the request; the first outcome logged (commit or abort) is final;
* request lifecycle: counters; a rescue changes the owner; a finished or
  aborted request forgets its owner and any migration record left for it.

Positions: per stream, a sequence equal to the last folded one is a repeat and
a no-op; a smaller one raises :class:`PositionRegressed`; on a stream named in
``state.gapless_streams`` (the events stream) a skipped sequence raises
:class:`PositionGap`. The loads stream drops old reports by retention, so it is
folded without the gap check. Bodies that are not events (RPCs, token deltas)
advance the position and count as ignored.

Which interleaving of the two streams was folded matters only for pending
dispatches, and only until the next few reports. Pure: no I/O, no clock.

Prefix-cache batches (the kv stream) are not folded here: they would make every
state copy carry millions of hashes. :mod:`scheduler.prefix_index` folds them
into an index with its own position and checks, and a ``Dispatched`` records what
it read there (``cached_blocks``, ``kv_seq``), so the decision still recomputes
from this state alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import msgspec

from scheduler.cluster_state import (
    ClusterState,
    InstanceRecord,
    InstanceStatus,
    MigrationPhase,
    MigrationRecord,
    PendingDispatch,
    RequestOwner,
    initial_state,
)
from scheduler.policy.load import InstanceLoad
from scheduler.policy.pairing import Pairing
from scheduler.policy.virtual_usage import blocks_for_tokens
from schemas.decisions import Dispatched, Paired, ScaleDown, ScaleUp, SchedulerTick, Unpaired
from schemas.envelope import Body
from schemas.instance import (
    InstanceFailed,
    InstanceHeartbeat,
    InstanceJoined,
    InstanceLeft,
    InstanceTerminating,
)
from schemas.load import LoadReport
from schemas.migration import Abort, Ack, Commit, CommitAck, MigrationStarted, PreAllocate, StageDone
from schemas.position import Position
from schemas.requests import (
    RequestAborted,
    RequestAdmitted,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPlaced,
    RequestPreempted,
    RequestRescued,
)

__all__ = [
    "FoldError",
    "InvalidPosition",
    "PositionGap",
    "PositionRegressed",
    "evolve",
    "replay",
    "with_lease_epoch",
]


class FoldError(Exception):
    """The fold cannot apply an event where it is."""


class InvalidPosition(FoldError):
    """A sequence below 1."""


class PositionRegressed(FoldError):
    """An event from before the last one folded from the same stream."""


class PositionGap(FoldError):
    """A gapless stream skipped a sequence: events are missing."""


_Changes = dict[str, Any]
_replace = msgspec.structs.replace
K = TypeVar("K")
V = TypeVar("V")


class _Owned(dict[K, V]):
    """A dict that only the running :func:`replay` can see, so it may be changed in place."""


def _copy(mapping: dict[K, V]) -> dict[K, V]:
    """Copy-on-write: a new dict, unless ``replay`` owns this one (intermediate states are unseen)."""
    return mapping if type(mapping) is _Owned else dict(mapping)


def _stale(state: ClusterState, epoch: int) -> _Changes | None:
    """None if a decision of ``epoch`` applies; the changes that count it as stale otherwise."""
    if epoch < state.epoch:
        return {"num_stale_decisions": state.num_stale_decisions + 1}
    return None


def _with_instance(state: ClusterState, record: InstanceRecord) -> dict[str, InstanceRecord]:
    instances = _copy(state.instances)
    instances[record.joined.instance_id] = record
    return instances


def _without_pairings_of(state: ClusterState, instance_id: str) -> dict[str, Pairing]:
    ended = [key for key, p in state.pairings.items() if instance_id in (p.source_id, p.destination_id)]
    if not ended:
        return state.pairings
    pairings = _copy(state.pairings)
    for key in ended:
        del pairings[key]
    return pairings


# -- instance lifecycle ---------------------------------------------------------


def _joined(state: ClusterState, body: InstanceJoined, seq: int) -> _Changes:
    instance_id = body.instance_id
    known = state.instances.get(instance_id)
    arrived = known is None or known.status is InstanceStatus.FAILED
    record = InstanceRecord(joined=body, status=InstanceStatus.ACTIVE, load=InstanceLoad.from_joined(body),
                            incarnation=seq, rejoined=known is not None)
    changes: _Changes = {
        "instances": _with_instance(state, record),
        "num_launching": state.num_launching - 1 if arrived and state.num_launching > 0
        else state.num_launching,
    }
    if known is not None:  # a new incarnation: what ran on the old one died with it
        changes["pairings"] = _without_pairings_of(state, instance_id)
        ended = [key for key, m in state.migrations.items() if instance_id in (m.source_id, m.destination_id)]
        if ended:
            migrations = _copy(state.migrations)
            for key in ended:
                del migrations[key]
            changes["migrations"] = migrations
        owned = [key for key, owner in state.owners.items() if owner.instance_id == instance_id]
        if owned:
            owners = _copy(state.owners)
            for key in owned:
                del owners[key]
            changes["owners"] = owners
    return changes


def _heartbeat(state: ClusterState, body: InstanceHeartbeat) -> _Changes | None:
    record = state.instances.get(body.instance_id)
    if record is None or body.seq <= record.last_heartbeat_seq:
        return None
    return {"instances": _with_instance(state, _replace(record, last_heartbeat_seq=body.seq))}


def _mark_terminating(state: ClusterState, instance_id: str) -> _Changes | None:
    record = state.instances.get(instance_id)
    if record is None or record.status is not InstanceStatus.ACTIVE:
        return None
    record = _replace(record, status=InstanceStatus.TERMINATING, load=record.load.as_terminating())
    return {"instances": _with_instance(state, record)}


def _terminating(state: ClusterState, body: InstanceTerminating) -> _Changes | None:
    return _mark_terminating(state, body.instance_id)


def _failed(state: ClusterState, body: InstanceFailed) -> _Changes | None:
    if body.epoch and (stale := _stale(state, body.epoch)) is not None:
        return stale
    changes: _Changes = {"epoch": max(state.epoch, body.epoch)}
    record = state.instances.get(body.instance_id)
    if record is not None and body.incarnation and body.incarnation != record.incarnation:
        return {**changes, "num_ignored": state.num_ignored + 1}  # an earlier incarnation's failure
    if record is not None and record.status is not InstanceStatus.FAILED:
        load = _replace(record.load, num_pending=0, pending_blocks=0)
        record = _replace(record, status=InstanceStatus.FAILED, load=load, pending=())
        changes["instances"] = _with_instance(state, record)
        changes["pairings"] = _without_pairings_of(state, body.instance_id)
    return changes


def _left(state: ClusterState, body: InstanceLeft) -> _Changes | None:
    if body.instance_id not in state.instances:
        return None
    instances = _copy(state.instances)
    del instances[body.instance_id]
    return {"instances": instances, "pairings": _without_pairings_of(state, body.instance_id)}


# -- load reports ---------------------------------------------------------------


def _load_report(state: ClusterState, body: LoadReport, stream_seq: int) -> _Changes | None:
    record = state.instances.get(body.instance_id)
    if record is None or record.status is InstanceStatus.FAILED:
        return {"num_ignored": state.num_ignored + 1}
    previous = record.load
    restarted = record.rejoined and body.seq == 1 < previous.report_seq  # the new incarnation's first
    if previous.reported and body.seq <= previous.report_seq and not restarted:
        return {"num_ignored": state.num_ignored + 1}
    pending = record.pending
    if pending:
        reflected = body.num_accepted - (previous.num_accepted if previous.reported and not restarted else 0)
        if reflected < 0:  # the agent's counter restarted: its report reflects everything it has
            reflected = len(pending)
        limit = state.pending_report_limit
        pending = tuple(
            _replace(p, reports_seen=p.reports_seen + 1)
            for p in pending[reflected:]
            if p.reports_seen + 1 < limit
        )
    load = InstanceLoad.from_report(
        body,
        record.joined,
        stream_seq=stream_seq,
        num_pending=len(pending),
        pending_blocks=sum(p.num_blocks for p in pending),
        terminating=record.status is InstanceStatus.TERMINATING,
        migration_group=previous.migration_group,
    )
    return {"instances": _with_instance(state, _replace(record, load=load, pending=pending))}


# -- decisions ------------------------------------------------------------------


def _dispatched(state: ClusterState, body: Dispatched) -> _Changes:
    if (stale := _stale(state, body.epoch)) is not None:
        return stale
    changes: _Changes = {"epoch": body.epoch, "num_dispatched": state.num_dispatched + 1}
    record = state.instances.get(body.instance_id)
    if record is not None and record.status is InstanceStatus.ACTIVE:
        blocks = blocks_for_tokens(body.num_prompt_tokens, record.joined.block_size)
        pending = (*record.pending, PendingDispatch(request_id=body.request_id, num_blocks=blocks))
        record = _replace(record, load=record.load.with_dispatch(blocks), pending=pending)
        changes["instances"] = _with_instance(state, record)
    return changes


def _paired(state: ClusterState, body: Paired) -> _Changes:
    if (stale := _stale(state, body.epoch)) is not None:
        return stale
    pairings = _copy(state.pairings)
    pairings[body.source_id] = Pairing(
        source_id=body.source_id, destination_id=body.destination_id,
        target_freeness=body.target_freeness, epoch=body.epoch,
        room_blocks=body.destination_room_blocks,
    )
    return {"epoch": body.epoch, "pairings": pairings}


def _unpaired(state: ClusterState, body: Unpaired) -> _Changes:
    if (stale := _stale(state, body.epoch)) is not None:
        return stale
    changes: _Changes = {"epoch": body.epoch}
    current = state.pairings.get(body.source_id)
    if current is not None and current.destination_id == body.destination_id:
        pairings = _copy(state.pairings)
        del pairings[body.source_id]
        changes["pairings"] = pairings
    return changes


def _scale_up(state: ClusterState, body: ScaleUp) -> _Changes:
    if (stale := _stale(state, body.epoch)) is not None:
        return stale
    return {"epoch": body.epoch, "num_launching": state.num_launching + max(body.num_instances, 0)}


def _scale_down(state: ClusterState, body: ScaleDown) -> _Changes:
    if (stale := _stale(state, body.epoch)) is not None:
        return stale
    return {"epoch": body.epoch, **(_mark_terminating(state, body.instance_id) or {})}


def _tick(state: ClusterState, body: SchedulerTick) -> _Changes:
    if (stale := _stale(state, body.epoch)) is not None:
        return stale
    return {"epoch": body.epoch}


# -- migration steps ------------------------------------------------------------


def _with_migration(state: ClusterState, record: MigrationRecord) -> _Changes:
    migrations = _copy(state.migrations)
    migrations[record.migration_id] = record
    return {"migrations": migrations}


def _pre_allocate(state: ClusterState, body: PreAllocate) -> _Changes | None:
    record = state.migrations.get(body.migration_id)
    if record is None:
        if body.stage != 0:
            return None  # the migration ended already, or began before this fold's history
        return _with_migration(state, MigrationRecord(
            migration_id=body.migration_id, request_id=body.request_id, source_id=body.source_id,
            destination_id=body.destination_id, stage=0, phase=MigrationPhase.PRE_ALLOCATING,
        ))
    if body.stage <= record.stage:
        return None  # a repeat of a stage already logged
    return _with_migration(state, _replace(record, stage=body.stage, phase=MigrationPhase.PRE_ALLOCATING))


def _ack(state: ClusterState, body: Ack) -> _Changes | None:
    record = state.migrations.get(body.migration_id)
    if record is None or body.stage != record.stage or record.phase is not MigrationPhase.PRE_ALLOCATING:
        return None
    return _with_migration(state, _replace(record, phase=MigrationPhase.COPYING))


def _stage_done(state: ClusterState, body: StageDone) -> _Changes | None:
    record = state.migrations.get(body.migration_id)
    if record is None:
        return None
    copied = record.num_blocks_copied + body.num_blocks
    return _with_migration(state, _replace(record, num_blocks_copied=copied))


def _commit(state: ClusterState, body: Commit) -> _Changes | None:
    record = state.migrations.get(body.migration_id)
    if record is None:
        return None
    return _with_migration(state, _replace(record, phase=MigrationPhase.COMMITTING))


def _commit_ack(state: ClusterState, body: CommitAck) -> _Changes | None:
    record = state.migrations.get(body.migration_id)
    if record is None:
        return None  # an outcome was logged first; the first outcome is final
    migrations = _copy(state.migrations)
    del migrations[body.migration_id]
    owners = _copy(state.owners)
    owners[body.request_id] = RequestOwner(
        request_id=body.request_id, instance_id=body.destination_id,
        owner_epoch=body.owner_epoch, migration_id=body.migration_id,
    )
    return {
        "migrations": migrations, "owners": owners,
        "num_migrations_committed": state.num_migrations_committed + 1,
    }


def _abort(state: ClusterState, body: Abort) -> _Changes | None:
    if body.migration_id not in state.migrations:
        return None
    migrations = _copy(state.migrations)
    del migrations[body.migration_id]
    return {"migrations": migrations, "num_migrations_aborted": state.num_migrations_aborted + 1}


# -- request lifecycle ----------------------------------------------------------


def _arrived(state: ClusterState, body: RequestArrived) -> _Changes:
    return {"num_requests_arrived": state.num_requests_arrived + 1}


def _no_change(
    state: ClusterState,
    body: RequestPlaced | RequestFirstToken | RequestAdmitted | RequestPreempted | MigrationStarted,
) -> None:
    """Events for timelines only: they change nothing the scheduler decides from."""
    return None


def _ended(state: ClusterState, body: RequestFinished | RequestAborted) -> _Changes:
    changes: _Changes = {"num_requests_finished": state.num_requests_finished + 1}
    if body.request_id in state.owners:
        owners = _copy(state.owners)
        del owners[body.request_id]
        changes["owners"] = owners
    left = [key for key, m in state.migrations.items() if m.request_id == body.request_id]
    if left:
        migrations = _copy(state.migrations)
        for key in left:
            del migrations[key]
        changes["migrations"] = migrations
    return changes


def _rescued(state: ClusterState, body: RequestRescued) -> _Changes:
    previous = state.owners.get(body.request_id)
    owners = _copy(state.owners)
    owners[body.request_id] = RequestOwner(
        request_id=body.request_id, instance_id=body.new_instance_id,
        owner_epoch=1 if previous is None else previous.owner_epoch + 1,
    )
    return {"owners": owners}


_Rule = Callable[[ClusterState, Any], _Changes | None]

_RULES: dict[type, _Rule] = {  # LoadReport and InstanceJoined (they need the position): in evolve
    InstanceHeartbeat: _heartbeat,
    InstanceTerminating: _terminating,
    InstanceFailed: _failed,
    InstanceLeft: _left,
    Dispatched: _dispatched,
    Paired: _paired,
    Unpaired: _unpaired,
    ScaleUp: _scale_up,
    ScaleDown: _scale_down,
    SchedulerTick: _tick,
    PreAllocate: _pre_allocate,
    Ack: _ack,
    StageDone: _stage_done,
    Commit: _commit,
    CommitAck: _commit_ack,
    Abort: _abort,
    RequestArrived: _arrived,
    RequestPlaced: _no_change,
    RequestFirstToken: _no_change,
    RequestAdmitted: _no_change,
    RequestPreempted: _no_change,
    MigrationStarted: _no_change,
    RequestFinished: _ended,
    RequestAborted: _ended,
    RequestRescued: _rescued,
}


def evolve(state: ClusterState, position: Position, body: Body) -> ClusterState:
    """The state after folding ``body`` found at ``position``. Never mutates ``state``."""
    stream, seq = position.stream, position.seq
    if seq < 1:
        raise InvalidPosition(f"{stream}: sequence {seq} < 1")
    last = state.positions.get(stream, 0)
    if seq == last:
        return state
    if seq < last:
        raise PositionRegressed(f"{stream}: sequence {seq} after {last}")
    if seq != last + 1 and stream in state.gapless_streams:
        raise PositionGap(f"{stream}: sequence {seq} after {last}; {seq - last - 1} missing")
    positions = _copy(state.positions)
    positions[stream] = seq
    if type(body) is LoadReport:
        changes = _load_report(state, body, seq)
    elif type(body) is InstanceJoined:
        changes = _joined(state, body, seq)
    else:
        rule = _RULES.get(type(body))
        changes = {"num_ignored": state.num_ignored + 1} if rule is None else rule(state, body)
    if changes:
        return _replace(state, positions=positions, num_events=state.num_events + 1, **changes)
    return _replace(state, positions=positions, num_events=state.num_events + 1)


def replay(
    events: Iterable[tuple[Position, Body]], state: ClusterState | None = None
) -> ClusterState:
    """Fold ``events`` (in order) onto ``state`` (a snapshot) or an empty state.

    The same as calling :func:`evolve` for each event, but the intermediate
    states are never seen, so their dicts are updated in place (``state`` itself
    is left untouched): the cost per event does not grow with the state's size.
    """
    start = initial_state() if state is None else state
    current = _replace(start, **{name: _Owned(getattr(start, name)) for name in _MAPS})
    for position, body in events:
        current = evolve(current, position, body)
    return _replace(current, **{name: dict(getattr(current, name)) for name in _MAPS})


_MAPS = ("positions", "instances", "pairings", "migrations", "owners")


def with_lease_epoch(state: ClusterState, epoch: int) -> ClusterState:
    """The state under a newly acquired lease epoch (must not go backwards)."""
    if epoch < state.epoch:
        raise FoldError(f"lease epoch {epoch} is older than the current {state.epoch}")
    return state if epoch == state.epoch else _replace(state, epoch=epoch)
