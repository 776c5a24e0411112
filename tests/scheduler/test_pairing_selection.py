"""Migration pairing and request selection, with worked numbers."""

from __future__ import annotations

import math

import pytest

from scheduler.config import PairingConfig, PolicyConfig, shoal_pairing
from scheduler.policy import (
    InstanceLoad,
    Pairing,
    RunningRequest,
    UnpairReason,
    instance_freeness,
    load_freeness,
    pair_instances,
    select_requests_to_migrate,
)
from scheduler.policy.load import room_blocks
from schemas.decisions import Paired, Unpaired
from schemas.load import PriorityLoad

CONFIG = PolicyConfig(pairing=PairingConfig(low_freeness=3.0, high_freeness=30.0))


def with_freeness(instance_id: str, f: float, *, group: str = "m", **extra: object) -> InstanceLoad:
    """An instance with 10 running requests whose freeness is exactly ``f`` (M = 1000)."""
    used = int(1000 - 10 * f)
    return InstanceLoad(
        instance_id=instance_id, num_total_blocks=1000, reported=True, migration_group=group,
        running=(PriorityLoad(priority=0, num_running=10, num_blocks=used),), **extra,  # type: ignore[arg-type]
    )


def freeness_of(loads: list[InstanceLoad]) -> dict[str, float]:
    return {ld.instance_id: load_freeness(ld, CONFIG) for ld in loads}


def test_lowest_source_pairs_with_highest_destination_repeatedly() -> None:
    loads = [with_freeness("a", -5), with_freeness("b", 1), with_freeness("c", 90),
             with_freeness("d", 50), with_freeness("e", 10)]
    assert freeness_of(loads) == {"a": -5, "b": 1, "c": 90, "d": 50, "e": 10}
    plan = pair_instances(loads, [], CONFIG)
    assert [(p.source_id, p.destination_id) for p in plan.paired] == [("a", "c"), ("b", "d")]
    first = plan.paired[0]
    assert (first.source_freeness, first.destination_freeness, first.target_freeness) == (-5, 90, 3.0)
    assert first.to_event(2) == Paired(epoch=2, source_id="a", destination_id="c", target_freeness=3.0,
                                       source_freeness=-5, destination_freeness=90)


def test_more_sources_than_destinations_leaves_the_least_urgent_unpaired() -> None:
    plan = pair_instances([with_freeness("a", 2), with_freeness("b", -9), with_freeness("c", 40)], [], CONFIG)
    assert [(p.source_id, p.destination_id) for p in plan.paired] == [("b", "c")]


def test_a_pair_lasts_until_one_side_leaves_its_band() -> None:
    pair = Pairing(source_id="a", destination_id="c", target_freeness=3.0)
    still = pair_instances([with_freeness("a", 2.5), with_freeness("c", 31)], [pair], CONFIG)
    assert still.kept == (pair,) and still.unpaired == () and still.paired == ()
    recovered = pair_instances([with_freeness("a", 3), with_freeness("c", 31)], [pair], CONFIG)
    assert [u.reason for u in recovered.unpaired] == [UnpairReason.SOURCE_RECOVERED]
    assert recovered.unpaired[0].to_event(1) == Unpaired(
        epoch=1, source_id="a", destination_id="c", reason=UnpairReason.SOURCE_RECOVERED)
    filled = pair_instances([with_freeness("a", 1), with_freeness("c", 30)], [pair], CONFIG)
    assert [u.reason for u in filled.unpaired] == [UnpairReason.DESTINATION_FILLED]


def test_pairs_end_when_an_instance_goes_or_the_destination_terminates() -> None:
    pair = Pairing(source_id="a", destination_id="c", target_freeness=3.0)
    gone = pair_instances([with_freeness("c", 90)], [pair], CONFIG)
    assert [u.reason for u in gone.unpaired] == [UnpairReason.SOURCE_GONE]
    gone = pair_instances([with_freeness("a", 0)], [pair], CONFIG)
    assert [u.reason for u in gone.unpaired] == [UnpairReason.DESTINATION_GONE]
    ending = pair_instances([with_freeness("a", 0), with_freeness("c", 90, terminating=True)], [pair], CONFIG)
    assert [u.reason for u in ending.unpaired] == [UnpairReason.DESTINATION_TERMINATING]


def test_a_terminating_instance_is_drained_first_and_released_once_empty() -> None:
    draining = with_freeness("t", 50, terminating=True)
    assert load_freeness(draining, CONFIG) == -math.inf
    plan = pair_instances([with_freeness("a", -20), draining, with_freeness("c", 80), with_freeness("d", 70)],
                          [], CONFIG)
    assert [(p.source_id, p.destination_id) for p in plan.paired] == [("t", "c"), ("a", "d")]
    empty = InstanceLoad(instance_id="t", num_total_blocks=1000, reported=True, terminating=True,
                         migration_group="m")
    done = pair_instances([empty, with_freeness("c", 80)], [Pairing(source_id="t", destination_id="c",
                                                                     target_freeness=3.0)], CONFIG)
    assert [u.reason for u in done.unpaired] == [UnpairReason.SOURCE_DRAINED]
    assert done.paired == ()  # nothing running: nothing to migrate


def test_only_instances_of_the_same_model_and_kv_layout_pair() -> None:
    loads = [with_freeness("a", -5, group="llama"), with_freeness("b", 99, group="mistral"),
             with_freeness("c", 40, group="llama")]
    plan = pair_instances(loads, [], CONFIG)
    assert [(p.source_id, p.destination_id) for p in plan.paired] == [("a", "c")]


def test_instances_in_a_pair_are_not_paired_again() -> None:
    pair = Pairing(source_id="a", destination_id="c", target_freeness=3.0)
    plan = pair_instances([with_freeness("a", -5), with_freeness("b", -1), with_freeness("c", 90)], [pair],
                          CONFIG)
    assert plan.kept == (pair,) and plan.paired == ()


def test_pairing_thresholds_are_validated() -> None:
    with pytest.raises(ValueError):
        PairingConfig(low_freeness=10, high_freeness=10)
    assert PairingConfig(low_freeness=1, high_freeness=5, target_freeness=4).source_target == 4


# -- request selection ------------------------------------------------------------


SELECTION = [
    RunningRequest(request_id="r1", priority=0, num_blocks=200, num_tokens=300),
    RunningRequest(request_id="r2", priority=0, num_blocks=100, num_tokens=150),
    RunningRequest(request_id="r3", priority=-1, num_blocks=100, num_tokens=100),  # high: +100 headroom
    RunningRequest(request_id="r4", priority=1, num_blocks=300, num_tokens=500),  # background
]


def select(target: float, **kw: object) -> list[str]:
    chosen = select_requests_to_migrate(
        SELECTION, num_total_blocks=1000, head_of_line_demand=0, target_freeness=target, config=CONFIG,
        **kw,  # type: ignore[arg-type]
    )
    return [r.request_id for r in chosen]


def test_selection_takes_lower_priority_first_then_shorter_sequences_until_the_target() -> None:
    # V = 700 physical + 100 headroom = 800, B = 4: F = 50
    assert instance_freeness(1000, SELECTION, 0, config=CONFIG) == 50
    assert select(50) == []
    # r4 (priority 1) goes first: V = 500, B = 3, F = 166.7
    assert select(100) == ["r4"]
    # then r2 (priority 0, 150 tokens, shorter than r1): V = 400, B = 2, F = 300
    assert select(300) == ["r4", "r2"]
    # then r1: V = 200 (r3 + its headroom), B = 1, F = 800; r3, the high-priority one, goes last
    assert select(800) == ["r4", "r2", "r1"]
    assert select(10_000) == ["r4", "r2", "r1", "r3"]


def test_selection_respects_exclusions_limits_and_drains_a_terminating_instance() -> None:
    assert select(100, exclude={"r4"}) == ["r2"]  # without r2: V = 700, B = 3, F = 100
    assert select(10_000, max_requests=2) == ["r4", "r2"]
    assert select(-10**9, terminating=True) == ["r4", "r2", "r1", "r3"]


ROOM = PolicyConfig(pairing=shoal_pairing(3.0, 30.0))  # the paper's band, to compare with CONFIG


def test_room_check_pairs_only_destinations_with_room_and_the_pair_carries_it() -> None:
    # "big" runs one request holding 965 of 1000 blocks: freeness 35, above the band, and room 35.
    # "roomy" has 10 requests on 500 blocks: freeness 50, room 500.
    big = InstanceLoad(instance_id="big", num_total_blocks=1000, reported=True, migration_group="m",
                       running=(PriorityLoad(priority=0, num_running=1, num_blocks=965),))
    full = InstanceLoad(instance_id="full", num_total_blocks=1000, reported=True, migration_group="m",
                        running=(PriorityLoad(priority=0, num_running=4, num_blocks=960),),
                        head_of_line_demand=40, waiting_demand=40, num_waiting=1)  # F = 0: a source
    roomy = with_freeness("roomy", 50)
    assert room_blocks(big, ROOM) == 35 and room_blocks(roomy, ROOM) == 500
    paper = pair_instances([full, big], [], CONFIG)
    assert [(p.source_id, p.destination_id, p.destination_room_blocks) for p in paper.paired] == [
        ("full", "big", -1)
    ]
    # with the room check "big" cannot hold full's mean request (240 blocks)
    assert pair_instances([full, big], [], ROOM).paired == ()
    checked = pair_instances([full, big, roomy], [], ROOM)
    assert [(p.source_id, p.destination_id) for p in checked.paired] == [("full", "roomy")]
    assert checked.paired[0].to_event(1).destination_room_blocks == 500


def test_selection_sends_only_what_fits_in_the_destinations_room() -> None:
    running = [RunningRequest(priority=0, num_blocks=b, request_id=f"r{b}", num_tokens=16 * b)
               for b in (10, 40, 300)]
    kwargs = dict(num_total_blocks=400, head_of_line_demand=0, target_freeness=1000.0, config=CONFIG)
    assert [r.request_id for r in select_requests_to_migrate(running, **kwargs)] == ["r10", "r40", "r300"]  # type: ignore[arg-type]
    # 100 blocks of room, 2 blocks of margin each: r10 (12) and r40 (42) fit, r300 does not
    fits = select_requests_to_migrate(running, room_blocks=100, margin_blocks=2, **kwargs)  # type: ignore[arg-type]
    assert [r.request_id for r in fits] == ["r10", "r40"]
    # the room is shared: 50 blocks take r10 (12), then r40 needs 42 > 38 left
    shared = select_requests_to_migrate(running, room_blocks=50, margin_blocks=2, **kwargs)  # type: ignore[arg-type]
    assert [r.request_id for r in shared] == ["r10"]
    assert select_requests_to_migrate(running, room_blocks=0, **kwargs) == ()  # type: ignore[arg-type]


def test_shoals_default_band_receives_only_into_instances_above_freeness_60() -> None:
    assert (shoal_pairing().low_freeness, shoal_pairing().high_freeness) == (3.0, 60.0)
    default = PolicyConfig(pairing=shoal_pairing())
    source = with_freeness("s", 1)
    assert pair_instances([source, with_freeness("d", 50)], [], default).paired == ()
    plan = pair_instances([source, with_freeness("d", 61)], [], default)
    assert [p.destination_id for p in plan.paired] == ["d"]
