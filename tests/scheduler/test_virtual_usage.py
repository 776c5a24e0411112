"""Virtual usage and freeness follow the paper's rules, with worked numbers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.config import PolicyConfig, PriorityClass
from scheduler.policy import (
    InstanceLoad,
    RunningRequest,
    blocks_for_tokens,
    freeness,
    group_running,
    instance_freeness,
    load_freeness,
    load_scaling_freeness,
    load_virtual_usage,
    request_virtual_usage,
    scaling_freeness,
    virtual_usage,
    virtual_usage_of_groups,
)
from schemas.load import LoadReport, PriorityLoad

CONFIG = PolicyConfig()  # high (< 0): 100 blocks of headroom; normal (>= 0): none


def normal(blocks: int, request_id: str = "") -> RunningRequest:
    return RunningRequest(priority=0, num_blocks=blocks, request_id=request_id)


def high(blocks: int, request_id: str = "") -> RunningRequest:
    return RunningRequest(priority=-1, num_blocks=blocks, request_id=request_id)


def test_the_issue_example_head_of_line_demand_makes_freeness_negative() -> None:
    # M = 1000, running 100 and 300 blocks, head-of-line demand 700: F = (1000 - 1100) / 2 = -50
    running = [normal(100), normal(300)]
    assert virtual_usage(running, 700, config=CONFIG) == 1100
    assert instance_freeness(1000, running, 700, config=CONFIG) == -50


def test_normal_running_requests_count_their_physical_blocks() -> None:
    running = [normal(100), normal(300)]
    assert virtual_usage(running, 0, config=CONFIG) == 400
    assert instance_freeness(1000, running, 0, config=CONFIG) == 300  # (1000 - 400) / 2


def test_high_priority_headroom_is_split_among_that_class_running_requests() -> None:
    # two high-priority requests of 50 blocks share 100 blocks of headroom: 100 each
    running = [high(50), high(50), normal(200)]
    assert request_virtual_usage(running[0], 2, config=CONFIG) == 100
    assert request_virtual_usage(running[2], 1, config=CONFIG) == 200
    assert virtual_usage(running, 0, config=CONFIG) == 400  # 300 physical + 100 headroom once
    assert instance_freeness(1000, running, 0, config=CONFIG) == 200  # (1000 - 400) / 3


def test_headroom_is_per_class_not_per_priority_value() -> None:
    # priorities -1 and -5 are both "high": the headroom is reserved once, not twice
    running = [RunningRequest(priority=-1, num_blocks=10), RunningRequest(priority=-5, num_blocks=10)]
    assert virtual_usage(running, 0, config=CONFIG) == 120


def test_only_the_head_of_line_request_counts_among_queued_ones() -> None:
    base = dict(instance_id="a", num_total_blocks=1000, reported=True,
                running=(PriorityLoad(priority=0, num_running=1, num_blocks=100),), head_of_line_demand=200)
    one_waiting = InstanceLoad(**base, num_waiting=1, waiting_demand=200)  # type: ignore[arg-type]
    many_waiting = InstanceLoad(**base, num_waiting=9, waiting_demand=5000)  # type: ignore[arg-type]
    assert load_freeness(one_waiting, CONFIG) == load_freeness(many_waiting, CONFIG) == 700


def test_a_terminating_instance_has_infinite_usage_and_minus_infinite_freeness() -> None:
    running = [normal(10)]
    assert virtual_usage(running, 0, config=CONFIG, terminating=True) == math.inf
    assert instance_freeness(1000, running, 0, config=CONFIG, terminating=True) == -math.inf


def test_an_empty_batch_counts_as_one() -> None:
    assert freeness(1000, 300.0, 0) == 700
    assert instance_freeness(1000, [], 300, config=CONFIG) == 700


def test_reserved_blocks_add_usage_but_not_batch() -> None:
    assert instance_freeness(1000, [normal(100)], 0, config=CONFIG, num_reserved_blocks=200) == 700


def test_scaling_freeness_ignores_headroom_queue_and_fake_request() -> None:
    load = InstanceLoad(
        instance_id="a", num_total_blocks=1000, reported=True, terminating=True, head_of_line_demand=900,
        running=(PriorityLoad(priority=-1, num_running=2, num_blocks=200),),
    )
    assert load_virtual_usage(load, CONFIG) == math.inf
    assert load_scaling_freeness(load) == 400  # (1000 - 200) / 2
    assert scaling_freeness(1000, 200, 2) == 400


def test_blocks_for_tokens_rounds_up() -> None:
    assert [blocks_for_tokens(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError):
        blocks_for_tokens(1, 0)


def test_priority_mapping_and_config_validation() -> None:
    assert CONFIG.priority_class(-3).name == "high"
    assert CONFIG.priority_class(0).name == "normal"
    assert CONFIG.priority_class(10**9).name == "normal"
    three = PolicyConfig(priority_classes=(
        PriorityClass("urgent", -10, 300), PriorityClass("high", -1, 100), PriorityClass("normal", 5, 0),
    ))
    assert three.headroom_blocks(-20) == 300
    assert three.headroom_blocks(-2) == 100
    assert three.headroom_blocks(99) == 0  # above every bound: the last class
    with pytest.raises(ValueError):
        PolicyConfig(priority_classes=(PriorityClass("a", 5), PriorityClass("b", 1)))
    with pytest.raises(ValueError):
        PolicyConfig(priority_classes=(PriorityClass("a", 1), PriorityClass("a", 5)))
    with pytest.raises(ValueError):
        PriorityClass("a", 0, headroom_blocks=-1)


def test_a_load_report_gives_the_same_freeness_as_the_agent() -> None:
    running = [high(40), normal(100), normal(60)]
    agent_f = instance_freeness(1000, running, 50, config=CONFIG)
    report = LoadReport(
        instance_id="a", seq=1, num_total_blocks=1000, num_free_blocks=800, num_reserved_blocks=0,
        running=group_running(running), head_of_line_demand=50, num_waiting=2, batch_size=3,
        freeness=agent_f, virtual_usage=virtual_usage(running, 50, config=CONFIG), num_accepted=5,
    )
    assert load_freeness(InstanceLoad.from_report(report), CONFIG) == agent_f == (1000 - 350) / 3


requests = st.lists(
    st.builds(RunningRequest, priority=st.integers(-3, 3), num_blocks=st.integers(0, 500)), max_size=40
)


@settings(max_examples=150, deadline=None)
@given(running=requests, hol=st.integers(0, 800), reserved=st.integers(0, 100))
def test_request_level_and_aggregated_usage_agree(
    running: list[RunningRequest], hol: int, reserved: int
) -> None:
    groups = group_running(running)
    by_requests = virtual_usage(running, hol, config=CONFIG, num_reserved_blocks=reserved)
    by_groups = virtual_usage_of_groups(groups, hol, config=CONFIG, num_reserved_blocks=reserved)
    assert by_requests == by_groups
    counts: dict[str, int] = {}
    for r in running:
        name = CONFIG.priority_class(r.priority).name
        counts[name] = counts.get(name, 0) + 1
    per_request = sum(
        request_virtual_usage(r, counts[CONFIG.priority_class(r.priority).name], config=CONFIG)
        for r in running
    )
    assert per_request + hol + reserved == pytest.approx(by_requests)
    assert sum(g.num_running for g in groups) == len(running)
