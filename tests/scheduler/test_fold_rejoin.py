"""An agent that restarts and joins again under its own id is a new incarnation in the fold.

Its old incarnation's pending dispatches, pairs, migrations in flight and
owned requests do not carry over; a failure decided about the old incarnation
does not fail the new one; and the new incarnation's reports count even when
the old one's later reports were folded after its join (both streams in one
segment, as a scheduler that was down meanwhile folds them).
"""

from __future__ import annotations

from scheduler.cluster_state import InstanceStatus, owner_of
from scheduler.recompute import failure_event
from schemas.decisions import Dispatched, Paired
from schemas.instance import FailureInputs, InstanceFailed
from schemas.migration import CommitAck, PreAllocate
from schemas.reasons import FailureReason
from tests.scheduler.events import EVENTS, joined, report
from tests.scheduler.test_fold import Log


def _busy_cluster() -> Log:
    """Instances a and b; a runs requests, is paired with b, migrates one to b and owns another."""
    log = Log()
    log.add(joined("a"))
    log.add(joined("b"))
    log.load(report("a", 7, running=((0, 3, 300),), accepted=3))
    log.add(Dispatched(epoch=1, request_id="r-pending", instance_id="a", policy="freeness",
                       num_prompt_tokens=160))
    log.add(Paired(epoch=1, source_id="a", destination_id="b", target_freeness=3.0,
                   source_freeness=0.0, destination_freeness=90.0))
    log.add(PreAllocate(migration_id="m-out", request_id="r-moving", source_id="a", destination_id="b",
                        stage=0, num_blocks=10))
    log.add(PreAllocate(migration_id="m-in", request_id="r-arriving", source_id="b", destination_id="a",
                        stage=0, num_blocks=10))
    log.add(PreAllocate(migration_id="m-moved", request_id="r-moved", source_id="b", destination_id="a",
                        stage=0, num_blocks=10))
    log.add(CommitAck(migration_id="m-moved", request_id="r-moved", destination_id="a", owner_epoch=1,
                      resumed_at=1.0))
    state = log.state
    assert state.instances["a"].pending and "a" in state.pairings and len(state.migrations) == 2
    assert owner_of(state, "r-moved") is not None
    return log


def _assert_nothing_of_the_old_incarnation(log: Log, join_seq: int) -> None:
    state = log.state
    record = state.instances["a"]
    assert record.status is InstanceStatus.ACTIVE
    assert (record.incarnation, record.rejoined) == (join_seq, True)
    assert record.pending == () and not record.load.reported and record.load.num_used_blocks == 0
    assert record.load.num_pending == 0
    assert state.pairings == {}  # its pair ended with the old incarnation
    assert state.migrations == {}  # migrations out of and into the dead process are over
    assert owner_of(state, "r-moved") is None  # not resurrected on the new process
    assert "b" in state.instances and state.instances["b"].status is InstanceStatus.ACTIVE


def test_a_failed_agent_that_joins_again_starts_empty() -> None:
    log = _busy_cluster()
    log.add(InstanceFailed(instance_id="a", reason=FailureReason.NO_LOAD_REPORT, epoch=1))
    log.add(joined("a"))
    _assert_nothing_of_the_old_incarnation(log, log.seq[EVENTS])


def test_an_agent_restarted_before_its_failure_was_detected_starts_empty_too() -> None:
    log = _busy_cluster()
    log.add(joined("a"))
    _assert_nothing_of_the_old_incarnation(log, log.seq[EVENTS])


def test_a_failure_of_the_old_incarnation_does_not_fail_the_new_one() -> None:
    log = _busy_cluster()
    old = log.state.instances["a"].incarnation
    inputs = FailureInputs(clock=100.0, last_seen=0.0, timeout_s=5.0, last_report_seq=1)
    decided = failure_event(log.state, "a", epoch=1, inputs=inputs, last_heartbeat=0.0)
    assert decided is not None and decided.incarnation == old
    log.add(joined("a"))  # the agent came back before the failure decided about it was logged
    state = log.add(decided)
    assert state.instances["a"].status is InstanceStatus.ACTIVE
    new = state.instances["a"].incarnation
    state = log.add(InstanceFailed(instance_id="a", reason=FailureReason.NO_LOAD_REPORT, epoch=1,
                                   incarnation=new))
    assert state.instances["a"].status is InstanceStatus.FAILED  # a failure of this one counts


def test_the_new_incarnations_reports_count_after_the_old_ones_later_reports() -> None:
    log = _busy_cluster()
    log.add(joined("a"))
    log.load(report("a", 8, running=((0, 3, 300),), accepted=3))  # the old process's last report
    state = log.load(report("a", 1, running=((0, 1, 20),), accepted=1))  # the new process's first
    load = state.instances["a"].load
    assert (load.report_seq, load.num_used_blocks) == (1, 20)
    state = log.load(report("a", 2, running=((0, 2, 40),), accepted=2))
    assert state.instances["a"].load.num_used_blocks == 40


def test_the_frontends_bypass_placements_on_the_old_incarnation_do_not_weigh_on_the_new_one() -> None:
    from frontend.board import LoadBoard
    from schemas.position import Position
    from tests.frontend.test_board import _joined, _report

    board = LoadBoard(stale_after=3.0)
    board.observe(Position("ev", 1), _joined("a"), now=0.0)
    board.observe(Position("loads", 1), _report("a", 5, used_blocks=10, running=1, accepted=40), now=0.0)
    for _ in range(3):  # placed while the scheduler was away; the agent died before reporting them
        board.record_placement("a", 20)
    assert board.loads(0.5)[0].pending_blocks == 60
    board.observe(Position("ev", 2), _joined("a"), now=1.0)  # restarted: its counter starts again
    board.observe(Position("loads", 2), _report("a", 1, used_blocks=0, running=0, accepted=0), now=1.0)
    [load] = board.loads(1.5)
    assert (load.report_seq, load.pending_blocks, load.num_used_blocks) == (1, 0, 0)
