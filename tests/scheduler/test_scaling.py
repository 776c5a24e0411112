"""Auto-scaling keeps the normal-usage freeness in its band, after a sustain period."""

from __future__ import annotations

from scheduler.config import ScalingConfig
from scheduler.policy import (
    InstanceLoad,
    ScaleDownDecision,
    ScaleUpDecision,
    ScalingState,
    average_scaling_freeness,
    decide_scaling,
)
from schemas.decisions import ScaleDown, ScaleUp
from schemas.load import PriorityLoad

SCALING = ScalingConfig(min_freeness=10, max_freeness=60, sustain_s=5, min_instances=1, max_instances=4)


def inst(instance_id: str, running: int, used: int, *, priority: int = 0, **extra: object) -> InstanceLoad:
    return InstanceLoad(
        instance_id=instance_id, num_total_blocks=1000, reported=True,
        running=(PriorityLoad(priority=priority, num_running=running, num_blocks=used),),
        **extra,  # type: ignore[arg-type]
    )


def run(loads: list[InstanceLoad], times: list[float], num_launching: int = 0,
        state: ScalingState | None = None) -> tuple[ScalingState, list[object]]:
    state = ScalingState() if state is None else state
    decisions = []
    for now in times:
        state, decision = decide_scaling(loads, now=now, state=state, config=SCALING,
                                         num_launching=num_launching)
        decisions.append(decision)
    return state, decisions


def test_average_is_the_cluster_as_one_instance_over_physical_usage() -> None:
    # (2000 - 900) / 20 = 55; head-of-line demand, headroom and starting/terminating instances do not count
    loads = [
        inst("a", 10, 500, head_of_line_demand=900), inst("b", 10, 400, priority=-1),
        inst("t", 1, 0, terminating=True), InstanceLoad(instance_id="new", num_total_blocks=1000),
    ]
    assert average_scaling_freeness(loads) == 55
    assert average_scaling_freeness([InstanceLoad(instance_id="new", num_total_blocks=1000)]) is None


def test_inside_the_band_nothing_happens() -> None:
    _, decisions = run([inst("a", 10, 500), inst("b", 10, 400)], [0, 10, 20])
    assert decisions == [None, None, None]


def test_below_the_band_for_the_sustain_period_scales_up_once_until_the_instance_joins() -> None:
    loads = [inst("a", 20, 900), inst("b", 20, 900)]  # (2000 - 1800) / 40 = 5 < 10
    state, decisions = run(loads, [0, 3, 5])
    assert decisions[:2] == [None, None]
    assert decisions[2] == ScaleUpDecision(num_instances=1, average_freeness=5)
    assert decisions[2].to_event(3) == ScaleUp(epoch=3, num_instances=1, average_freeness=5)
    # while the new instance is launching, no second scale-up ...
    state, decisions = run(loads, [6, 20, 100], num_launching=1, state=state)
    assert decisions == [None, None, None]
    # ... unless it never joins within the launch timeout
    _, decisions = run(loads, [5 + SCALING.launch_timeout_s + 1], num_launching=1, state=state)
    assert isinstance(decisions[0], ScaleUpDecision)


def test_a_short_dip_does_not_scale() -> None:
    low, ok = [inst("a", 20, 900)], [inst("a", 10, 500)]
    state, _ = run(low, [0, 4])
    state, _ = run(ok, [4.5], state=state)  # back in band: the timer resets
    _, decisions = run(low, [5, 9], state=state)
    assert decisions == [None, None]


def test_never_beyond_max_instances() -> None:
    loads = [inst(f"i{k}", 20, 900) for k in range(4)]
    _, decisions = run(loads, [0, 10, 20])
    assert decisions == [None, None, None]


def test_above_the_band_scales_down_the_instance_with_fewest_running_requests() -> None:
    loads = [inst("a", 3, 30), inst("b", 1, 10), inst("c", 1, 10, num_pending=2), inst("d", 2, 20)]
    assert average_scaling_freeness(loads) > 60
    _, decisions = run(loads, [0, 5])
    average = average_scaling_freeness(loads)
    assert decisions == [None, ScaleDownDecision(instance_id="b", average_freeness=average)]
    assert decisions[1].to_event(7) == ScaleDown(epoch=7, instance_id="b",
                                                   average_freeness=decisions[1].average_freeness)


def test_one_drain_at_a_time_and_never_below_min_instances() -> None:
    draining = [inst("a", 1, 10), inst("b", 1, 10), inst("t", 4, 10, terminating=True)]
    _, decisions = run(draining, [0, 10])
    assert decisions == [None, None]
    _, decisions = run([inst("a", 1, 10)], [0, 10])  # the last instance stays
    assert decisions == [None, None]


def test_below_min_instances_scales_up_at_once() -> None:
    config = ScalingConfig(min_instances=2)
    _, decision = decide_scaling([inst("a", 1, 10)], now=0, state=ScalingState(), config=config)
    assert decision == ScaleUpDecision(num_instances=1, average_freeness=990)
    _, decision = decide_scaling([], now=1, state=ScalingState(), config=config)
    assert isinstance(decision, ScaleUpDecision) and decision.num_instances == 2
    assert decision.to_event(1).average_freeness == -1.0  # nothing measured
