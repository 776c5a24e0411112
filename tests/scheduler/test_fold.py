"""The cluster-state fold: every event type, positions, lease epochs and snapshots."""

from __future__ import annotations

import math

import pytest

from scheduler.cluster_state import (
    ClusterState,
    InstanceStatus,
    MigrationPhase,
    decode_snapshot,
    encode_snapshot,
    initial_state,
    live_loads,
    owner_of,
)
from scheduler.config import PolicyConfig
from scheduler.fold import (
    FoldError,
    InvalidPosition,
    Position,
    PositionGap,
    PositionRegressed,
    evolve,
    replay,
    with_lease_epoch,
)
from scheduler.policy import load_freeness
from schemas.decisions import Dispatched, Paired, ScaleDown, ScaleUp, Unpaired
from schemas.envelope import Body
from schemas.instance import InstanceFailed, InstanceHeartbeat, InstanceLeft, InstanceTerminating
from schemas.migration import Abort, Ack, Commit, CommitAck, PreAllocate, StageDone
from schemas.reasons import CloseReason, FailureReason, FinishReason, MigrationAbortReason, UnpairReason
from schemas.requests import (
    RequestAborted,
    RequestArrived,
    RequestFinished,
    RequestFirstToken,
    RequestPlaced,
    RequestRescued,
)
from schemas.rpc import DispatchRequest
from tests.scheduler.events import EVENTS, LOADS, joined, report

CONFIG = PolicyConfig()


class Log:
    """Appends events to two streams with consecutive sequences, folding as it goes."""

    def __init__(self, state: ClusterState | None = None) -> None:
        self.state = initial_state(gapless_streams=(EVENTS,)) if state is None else state
        self.seq = {EVENTS: self.state.positions.get(EVENTS, 0), LOADS: self.state.positions.get(LOADS, 0)}
        self.entries: list[tuple[Position, Body]] = []

    def add(self, body: Body, stream: str = EVENTS) -> ClusterState:
        self.seq[stream] += 1
        position = Position(stream, self.seq[stream])
        self.entries.append((position, body))
        self.state = evolve(self.state, position, body)
        return self.state

    def load(self, body: Body) -> ClusterState:
        return self.add(body, LOADS)


def test_instance_lifecycle() -> None:
    log = Log()
    log.add(ScaleUp(epoch=1, num_instances=2, average_freeness=5.0))
    assert log.state.num_launching == 2
    state = log.add(joined("a"))
    assert state.num_launching == 1
    record = state.instances["a"]
    assert record.status is InstanceStatus.ACTIVE and not record.load.reported
    assert load_freeness(record.load, CONFIG) == 1000  # dispatchable as empty before its first report
    assert log.add(InstanceHeartbeat(instance_id="a", seq=4)).instances["a"].last_heartbeat_seq == 4
    state = log.add(InstanceTerminating(instance_id="a"))
    assert state.instances["a"].status is InstanceStatus.TERMINATING
    assert load_freeness(state.instances["a"].load, CONFIG) == -math.inf
    log.add(joined("b"))
    state = log.add(InstanceFailed(instance_id="b", reason=FailureReason.NO_LOAD_REPORT, epoch=1))
    assert state.instances["b"].status is InstanceStatus.FAILED
    assert [ld.instance_id for ld in live_loads(state)] == ["a"]
    state = log.add(InstanceLeft(instance_id="a"))
    assert "a" not in state.instances and state.num_launching == 0


def test_load_reports_replace_the_view_and_ignore_out_of_order_or_unknown_ones() -> None:
    log = Log()
    log.add(joined("a"))
    log.load(report("a", 2, running=((0, 2, 400),)))
    state = log.load(report("a", 1, running=((0, 1, 10),)))  # older agent seq: ignored
    assert state.instances["a"].load.num_used_blocks == 400
    assert state.instances["a"].load.stream_seq == 1
    assert state.num_ignored == 1
    state = log.load(report("ghost", 1))
    assert "ghost" not in state.instances and state.num_ignored == 2


def test_dispatches_count_until_the_accepted_counter_reflects_them() -> None:
    log = Log(initial_state(gapless_streams=(EVENTS,), pending_report_limit=3))
    log.add(joined("a"))
    log.load(report("a", 1, accepted=0))
    for i, tokens in enumerate((160, 320, 480)):  # 10, 20 and 30 blocks
        log.add(Dispatched(epoch=1, request_id=f"r{i}", instance_id="a", policy="freeness",
                           num_prompt_tokens=tokens))
    view = log.state.instances["a"].load
    assert (view.num_pending, view.pending_blocks) == (3, 60)
    assert load_freeness(view, CONFIG) == (1000 - 60) / 3
    # the agent accepted two of them: the two oldest stop counting
    state = log.load(report("a", 2, accepted=2, running=((0, 2, 30),)))
    assert [p.request_id for p in state.instances["a"].pending] == ["r2"]
    assert state.instances["a"].load.pending_blocks == 30
    # r2 never shows up: after three reports without it, it is taken as lost
    log.load(report("a", 3, accepted=2))
    assert log.state.instances["a"].load.num_pending == 1
    state = log.load(report("a", 4, accepted=2))
    assert state.instances["a"].load.num_pending == 0 and state.num_dispatched == 3


def test_decisions_of_an_older_lease_epoch_are_ignored() -> None:
    log = Log()
    log.add(joined("a"))
    log.add(joined("b"))
    state = log.add(Paired(epoch=2, source_id="a", destination_id="b", target_freeness=3.0,
                           source_freeness=0.0, destination_freeness=90.0))
    assert state.epoch == 2 and set(state.pairings) == {"a"}
    for stale in (
        Dispatched(epoch=1, request_id="r", instance_id="a", policy="freeness", num_prompt_tokens=5),
        Unpaired(epoch=1, source_id="a", destination_id="b", reason=UnpairReason.SOURCE_GONE),
        ScaleUp(epoch=1, num_instances=3, average_freeness=0.0),
        ScaleDown(epoch=1, instance_id="b", average_freeness=99.0),
        InstanceFailed(instance_id="a", reason=FailureReason.NO_LOAD_REPORT, epoch=1),
    ):
        state = log.add(stale)
    assert state.num_stale_decisions == 5
    assert state.num_dispatched == 0 and state.num_launching == 0 and "a" in state.pairings
    assert {r.status for r in state.instances.values()} == {InstanceStatus.ACTIVE}
    state = log.add(
        Unpaired(epoch=3, source_id="a", destination_id="b", reason=UnpairReason.SOURCE_RECOVERED)
    )
    assert state.epoch == 3 and state.pairings == {}
    state = log.add(ScaleDown(epoch=3, instance_id="b", average_freeness=99.0))
    assert state.instances["b"].status is InstanceStatus.TERMINATING
    assert with_lease_epoch(state, 5).epoch == 5
    with pytest.raises(FoldError):
        with_lease_epoch(state, 2)


def test_failure_or_departure_ends_pairs() -> None:
    log = Log()
    for i in "abcd":
        log.add(joined(i))
    log.add(Paired(epoch=1, source_id="a", destination_id="b", target_freeness=3.0,
                   source_freeness=0.0, destination_freeness=90.0))
    log.add(Paired(epoch=1, source_id="c", destination_id="d", target_freeness=3.0,
                   source_freeness=0.0, destination_freeness=90.0))
    state = log.add(InstanceFailed(instance_id="b", reason=FailureReason.NO_LOAD_REPORT))
    assert set(state.pairings) == {"c"}
    state = log.add(InstanceLeft(instance_id="c"))
    assert state.pairings == {}


def _migration(log: Log, migration_id: str, request_id: str = "r") -> None:
    log.add(PreAllocate(migration_id=migration_id, request_id=request_id, source_id="a",
                        destination_id="b", stage=0, num_blocks=10))
    log.add(Ack(migration_id=migration_id, stage=0, block_ids=tuple(range(10))))
    log.add(StageDone(migration_id=migration_id, stage=0, num_blocks=10, num_bytes=1, duration_s=0.1))
    log.add(Commit(migration_id=migration_id, request_id=request_id, source_id="a", destination_id="b",
                   token_ids=(1, 2), num_prompt_tokens=1, owner_epoch=0, suspended_at=1.0))


def test_the_committed_event_in_the_log_decides_who_owns_a_request() -> None:
    log = Log()
    _migration(log, "m1")
    record = log.state.migrations["m1"]
    assert (record.phase, record.num_blocks_copied) == (MigrationPhase.COMMITTING, 10)
    state = log.add(CommitAck(migration_id="m1", request_id="r", destination_id="b", owner_epoch=1,
                              resumed_at=2.0))
    assert owner_of(state, "r") is not None and owner_of(state, "r").instance_id == "b"  # type: ignore[union-attr]
    assert state.migrations == {} and state.num_migrations_committed == 1
    late = Abort(migration_id="m1", reason=MigrationAbortReason.PEER_FAILED, sender_id="a")
    state = log.add(late)  # after the outcome: ignored
    assert state.num_migrations_aborted == 0 and owner_of(state, "r").instance_id == "b"  # type: ignore[union-attr]
    _migration(log, "m2", "q")
    log.add(Abort(migration_id="m2", reason=MigrationAbortReason.COMMIT_TIMEOUT, sender_id="a"))
    state = log.add(CommitAck(migration_id="m2", request_id="q", destination_id="b", owner_epoch=1,
                              resumed_at=3.0))
    assert owner_of(state, "q") is None and state.num_migrations_aborted == 1


def test_request_lifecycle() -> None:
    log = Log()
    log.add(RequestArrived(request_id="r", num_prompt_tokens=5, max_tokens=5))
    log.add(RequestPlaced(request_id="r", instance_id="a"))
    log.add(RequestFirstToken(request_id="r", instance_id="a", ttft_s=0.1))
    state = log.add(RequestRescued(request_id="r", failed_instance_id="a", new_instance_id="c",
                                   num_tokens_kept=3))
    assert owner_of(state, "r").instance_id == "c"  # type: ignore[union-attr]
    _migration(log, "m", "r")
    state = log.add(RequestFinished(request_id="r", finish_reason=FinishReason.STOP, num_prompt_tokens=5,
                                    num_output_tokens=5, e2e_s=1.0))
    assert owner_of(state, "r") is None and state.migrations == {}  # nothing left for a finished request
    state = log.add(RequestAborted(request_id="x", reason=CloseReason.CLIENT))
    assert (state.num_requests_arrived, state.num_requests_finished) == (1, 2)


def test_positions_repeat_is_a_noop_regression_and_gap_are_errors() -> None:
    state = initial_state(gapless_streams=(EVENTS,))
    state = evolve(state, Position(EVENTS, 1), joined("a"))
    assert evolve(state, Position(EVENTS, 1), InstanceLeft(instance_id="a")) is state  # a repeat
    state = evolve(state, Position(EVENTS, 2), RequestArrived(request_id="r", num_prompt_tokens=1,
                                                              max_tokens=1))
    with pytest.raises(PositionRegressed):
        evolve(state, Position(EVENTS, 1), joined("a"))
    with pytest.raises(PositionGap):
        evolve(state, Position(EVENTS, 4), joined("b"))
    with pytest.raises(InvalidPosition):
        evolve(state, Position(LOADS, 0), report("a", 1))
    # the loads stream loses old reports to retention: gaps are fine there
    state = evolve(state, Position(LOADS, 17), report("a", 1))
    state = evolve(state, Position(LOADS, 40), report("a", 2))
    assert state.positions == {EVENTS: 2, LOADS: 40} and state.num_events == 4
    # a fold that starts after the stream's first sequences says where it starts
    late = initial_state(gapless_streams=(EVENTS,), start_positions={EVENTS: 99})
    with pytest.raises(PositionGap):
        evolve(initial_state(gapless_streams=(EVENTS,)), Position(EVENTS, 100), joined("a"))
    assert "a" in evolve(late, Position(EVENTS, 100), joined("a")).instances


def test_non_event_bodies_advance_the_position_and_are_counted() -> None:
    state = evolve(initial_state(), Position(EVENTS, 1), DispatchRequest(request_id="r", num_prompt_tokens=1))
    assert state.positions == {EVENTS: 1} and state.num_ignored == 1


def test_snapshot_round_trip_and_resume() -> None:
    log = Log()
    log.add(joined("a"))
    log.add(joined("b", model="other"))
    log.load(report("a", 1, running=((0, 3, 300), (-1, 1, 50)), accepted=1))
    log.add(Dispatched(epoch=1, request_id="r", instance_id="a", policy="freeness", num_prompt_tokens=40))
    log.add(Paired(epoch=1, source_id="a", destination_id="b", target_freeness=3.0,
                   source_freeness=0.0, destination_freeness=90.0))
    _migration(log, "m1")
    log.add(InstanceTerminating(instance_id="b"))
    snapshot = encode_snapshot(log.state)
    restored = decode_snapshot(snapshot)
    assert restored == log.state
    assert restored.instances["a"].status is InstanceStatus.ACTIVE
    tail = Log(restored)
    tail.add(CommitAck(migration_id="m1", request_id="r", destination_id="b", owner_epoch=1, resumed_at=1.0))
    log.add(CommitAck(migration_id="m1", request_id="r", destination_id="b", owner_epoch=1, resumed_at=1.0))
    assert tail.state == log.state
    with pytest.raises(PositionGap):
        evolve(restored, Position(EVENTS, restored.positions[EVENTS] + 2), joined("z"))


def test_replay_rebuilds_the_state() -> None:
    log = Log()
    log.add(joined("a"))
    log.load(report("a", 1, running=((0, 1, 10),)))
    log.add(Dispatched(epoch=1, request_id="r", instance_id="a", policy="freeness", num_prompt_tokens=40))
    assert replay(log.entries, initial_state(gapless_streams=(EVENTS,))) == log.state
    assert replay(log.entries).instances == log.state.instances  # default: no gap check


def test_replay_and_evolve_never_change_a_state_they_were_given() -> None:
    log = Log()
    log.add(joined("a"))
    log.load(report("a", 1, running=((0, 1, 10),)))
    start = log.state
    before = encode_snapshot(start)
    tail = Log(start)
    tail.add(Dispatched(epoch=1, request_id="r", instance_id="a", policy="freeness", num_prompt_tokens=40))
    tail.add(InstanceLeft(instance_id="a"))
    replayed = replay(tail.entries, start)
    assert encode_snapshot(start) == before  # replay worked on its own copies
    after_replay = encode_snapshot(replayed)
    evolve(replayed, Position(EVENTS, replayed.positions[EVENTS] + 1), joined("b"))
    assert encode_snapshot(replayed) == after_replay  # the replayed state is an ordinary immutable one
