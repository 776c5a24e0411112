"""The frontend's bypass fold: the scheduler's freeness dispatch over its own view of load reports."""

from __future__ import annotations

from frontend.board import LoadBoard
from scheduler.policy import InstanceLoad, PendingRequest, make_dispatcher
from schemas import FailureReason, InstanceFailed, InstanceJoined, KVLayout, LoadReport, ModelIdentity
from schemas.load import PriorityLoad
from schemas.position import Position


def _joined(instance_id: str) -> InstanceJoined:
    return InstanceJoined(
        instance_id=instance_id, num_blocks=100, block_size=16, model=ModelIdentity(model_id="m"),
        kv_layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype="float32"),
        transport_address="tcp://x", max_model_len=1024,
    )


def _report(instance_id: str, seq: int, used_blocks: int, running: int, accepted: int = 0) -> LoadReport:
    return LoadReport(
        instance_id=instance_id, seq=seq, num_total_blocks=100, num_free_blocks=100 - used_blocks,
        num_reserved_blocks=0,
        running=(PriorityLoad(priority=0, num_running=running, num_blocks=used_blocks),),
        head_of_line_demand=0, num_waiting=0, batch_size=running, freeness=0.0, virtual_usage=used_blocks,
        num_accepted=accepted,
    )


def _board() -> LoadBoard:
    board = LoadBoard(stale_after=3.0)
    board.observe(Position("ev", 1), _joined("a"), now=0.0)
    board.observe(Position("ev", 2), _joined("b"), now=0.0)
    board.observe(Position("loads", 1), _report("a", 1, used_blocks=80, running=4), now=1.0)
    board.observe(Position("loads", 2), _report("b", 1, used_blocks=10, running=1), now=1.0)
    return board


def test_bypass_places_where_the_scheduler_policy_would() -> None:
    board = _board()
    decision = board.choose("r1", 64, now=1.5)
    assert decision is not None and decision.instance_id == "b"
    expected = make_dispatcher("freeness").choose(
        PendingRequest(request_id="r1", num_prompt_tokens=64),
        [InstanceLoad.from_report(_report("a", 1, 80, 4), _joined("a")),
         InstanceLoad.from_report(_report("b", 1, 10, 1), _joined("b"))],
    )
    assert expected is not None and expected.instance_id == decision.instance_id
    assert decision.score == expected.score


def test_own_placements_count_until_a_report_reflects_them() -> None:
    board = _board()
    for _ in range(6):
        decision = board.choose("r", 16 * 10, now=1.5)
        assert decision is not None
        board.record_placement(decision.instance_id, decision.demand_blocks)
    loads = {load.instance_id: load for load in board.loads(1.5)}
    assert loads["b"].num_pending >= 1  # "b" is no longer empty in the frontend's eyes
    board.observe(Position("loads", 3), _report("b", 2, used_blocks=10, running=1, accepted=100), now=2.0)
    assert {load.instance_id: load for load in board.loads(2.0)}["b"].num_pending == 0


def test_silent_and_failed_instances_are_not_placed_on() -> None:
    board = _board()
    board.observe(Position("loads", 3), _report("a", 2, used_blocks=80, running=4), now=5.0)
    assert board.is_silent("b", 5.0) and not board.is_silent("a", 5.0)
    decision = board.choose("r", 16, now=5.0)
    assert decision is not None and decision.instance_id == "a"
    failed = InstanceFailed(instance_id="a", reason=FailureReason.NO_LOAD_REPORT)
    board.observe(Position("ev", 3), failed, now=5.0)
    assert board.is_failed("a")
    assert board.choose("r", 16, now=5.0) is None
    assert board.live_instance_ids(5.0) == []
