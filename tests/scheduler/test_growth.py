"""Expected decode growth: the output length learned online, the blocks it implies, and the
``blocks_ahead_growth`` rule that takes them off an instance's room (dispatch and moving queued
requests)."""

from __future__ import annotations

from scheduler.config import DispatchPolicy, PolicyConfig
from scheduler.policy import InstanceLoad, PendingRequest, make_dispatcher
from scheduler.policy.dispatch import requeue_choice, requeue_request
from scheduler.policy.growth import EWMA_HORIZON, OutputLengthEstimate, expected_growth_blocks
from scheduler.policy.load import queue_aware_score, starts_at_once
from schemas.load import PriorityLoad

CONFIG = PolicyConfig()


def _load(instance_id: str, used: int, *, growth: int = 0, total: int = 400) -> InstanceLoad:
    return InstanceLoad(
        instance_id=instance_id,
        num_total_blocks=total,
        running=(PriorityLoad(priority=0, num_running=1, num_blocks=used),),
        reported=True,
        expected_growth_blocks=growth,
    )


def test_the_estimate_is_the_mean_of_finished_outputs_then_follows_a_changing_workload() -> None:
    estimate = OutputLengthEstimate()
    assert estimate.expected_output_tokens == 0  # nothing finished: no growth is counted
    for length in (100, 200, 300):
        estimate.observe(length)
    assert estimate.expected_output_tokens == 200
    for _ in range(4 * EWMA_HORIZON):  # the workload's outputs became short
        estimate.observe(10)
    assert estimate.expected_output_tokens < 15


def test_growth_counts_what_decoding_requests_still_need_and_what_finishing_ones_give_back() -> None:
    # (num_tokens, num_prompt_tokens, num_blocks), block size 16, expected output 160 tokens
    fresh = (16, 16, 1)  # 160 tokens to go: 10 more blocks
    assert expected_growth_blocks([fresh], 160, 16) == 10
    assert expected_growth_blocks([fresh], 0, 16) == 0  # no estimate yet
    past = (16 + 200, 16, 14)  # already past the expected length: counts nothing
    assert expected_growth_blocks([past], 160, 16) == 0
    # two fresh ones grow side by side: 20 blocks before either finishes
    assert expected_growth_blocks([fresh, fresh], 160, 16) == 20
    # a nearly done request with many blocks frees them before the fresh one has grown much
    nearly_done = (1000 + 150, 1000, 72)  # 10 tokens to go
    assert expected_growth_blocks([fresh, nearly_done], 160, 16) == 2
    # with the big one finishing, the peak is while both still run, never the sum of all growth
    assert expected_growth_blocks([fresh, nearly_done], 160, 16) < 10 + 1


def test_dispatch_counts_growth_only_under_its_own_name() -> None:
    grower = _load("a", used=100, growth=280)  # few blocks now, its requests will fill it
    steady = _load("b", used=200)
    request = PendingRequest(request_id="r", num_prompt_tokens=64)
    old = make_dispatcher(DispatchPolicy.BLOCKS_AHEAD, CONFIG).choose(request, [grower, steady])
    new = make_dispatcher(DispatchPolicy.BLOCKS_AHEAD_GROWTH, CONFIG).choose(request, [grower, steady])
    assert old is not None and old.instance_id == "a"  # the round-3 rule: blocks held now
    assert new is not None and new.instance_id == "b" and new.policy is DispatchPolicy.BLOCKS_AHEAD_GROWTH
    # the room left after growth is the score; with no growth reported the two rules agree
    assert new.score == (400 - 200 - 4) / 2
    assert queue_aware_score(grower, 4, CONFIG, count_growth=True) == (400 - 100 - 280 - 4) / 2
    assert queue_aware_score(steady, 4, CONFIG, count_growth=True) == queue_aware_score(steady, 4, CONFIG)


def test_an_instance_whose_growth_leaves_no_room_has_the_deficit_ahead_of_the_request() -> None:
    full_soon = _load("a", used=100, growth=320)
    assert not starts_at_once(full_soon, 4, CONFIG)
    assert queue_aware_score(full_soon, 4, CONFIG, count_growth=True) == -(100 + 320 + 4 - 400)
    assert starts_at_once(_load("b", used=100, growth=200), 4, CONFIG)


def test_a_queued_request_does_not_move_where_the_running_requests_will_need_the_room() -> None:
    stalled = _load("src", used=390)
    filling = _load("dst", used=100, growth=320)  # room now, not once its requests have grown
    request = PendingRequest(request_id="q", num_prompt_tokens=64)
    for policy in (DispatchPolicy.BLOCKS_AHEAD, DispatchPolicy.BLOCKS_AHEAD_GROWTH):
        dispatcher = make_dispatcher(policy, CONFIG)
        assert requeue_choice(dispatcher, request, "src", [stalled, filling], config=CONFIG) is None
        # an instance with less room now but room after its growth takes it
        roomy = _load("dst2", used=200, growth=50)
        loads = [stalled, filling, roomy]
        moved = requeue_choice(dispatcher, request, "src", loads, config=CONFIG)
        assert moved is not None and moved.instance_id == "dst2"
        # the log replays the move as a dispatch of the request with what it excluded
        offered = requeue_request(request, "src", loads, CONFIG)
        assert offered.exclude == ("src", "dst")
        assert dispatcher.choose(offered, loads) == moved
    # without growth in the reports (older logs) the round-3 rule moves it where it fits now
    unknown = _load("dst", used=100)
    round3 = make_dispatcher(DispatchPolicy.BLOCKS_AHEAD, CONFIG)
    old = requeue_choice(round3, request, "src", [stalled, unknown], config=CONFIG)
    assert old is not None and old.instance_id == "dst"
