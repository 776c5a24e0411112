"""Dispatch policies choose as documented, deterministically, counting pending dispatches."""

from __future__ import annotations

import pytest

from scheduler.config import DispatchPolicy, PolicyConfig
from scheduler.policy import (
    InstanceLoad,
    PendingRequest,
    dispatch_pending,
    freeness_after_admit,
    infaas_load,
    load_freeness,
    make_dispatcher,
    order_pending,
)
from scheduler.policy.load import queue_aware_score
from schemas.decisions import Dispatched, LoadPosition
from schemas.load import PriorityLoad

CONFIG = PolicyConfig()


def load(instance_id: str, *groups: tuple[int, int], total: int = 1000, **extra: object) -> InstanceLoad:
    """An instance with running ``(num_running, num_blocks)`` groups of normal priority."""
    running = tuple(PriorityLoad(priority=0, num_running=n, num_blocks=b) for n, b in groups)
    return InstanceLoad(instance_id=instance_id, num_total_blocks=total, running=running,
                        reported=True, **extra)  # type: ignore[arg-type]


def choose(policy: DispatchPolicy, loads: list[InstanceLoad], tokens: int = 16, **kw: object) -> str | None:
    request = PendingRequest(request_id="r", num_prompt_tokens=tokens, **kw)  # type: ignore[arg-type]
    decision = make_dispatcher(policy, CONFIG).choose(request, loads)
    return None if decision is None else decision.instance_id


def test_freeness_and_freeness_after_admit_disagree_on_a_long_prompt() -> None:
    # A runs one long request (600 blocks): F = (1000 - 600) / 1 = 400.
    # B runs eight short ones (400 blocks): F = (1000 - 400) / 8 = 75.
    # A long prompt of 8000 tokens needs 500 blocks at block size 16.
    a, b = load("a", (1, 600)), load("b", (8, 400))
    assert (load_freeness(a, CONFIG), load_freeness(b, CONFIG)) == (400, 75)
    # The paper's rule looks only at F now and picks A ...
    assert choose(DispatchPolicy.FREENESS, [a, b], tokens=8000) == "a"
    # ... but A has 400 free blocks and the prompt needs 500: it would queue there.
    # After admission A would be at (1000 - 600 - 500) / 2 = -50 and B at (1000 - 400 - 500) / 9 = 11.1,
    # so the after-admit rule sends it to B, where it fits.
    assert freeness_after_admit(a, 500, CONFIG) == -50
    assert freeness_after_admit(b, 500, CONFIG) == pytest.approx(100 / 9)
    assert choose(DispatchPolicy.FREENESS_AFTER_ADMIT, [a, b], tokens=8000) == "b"
    # A short prompt goes to A under both rules.
    assert choose(DispatchPolicy.FREENESS_AFTER_ADMIT, [a, b], tokens=16) == "a"


def test_freeness_avoids_an_instance_with_a_blocked_queue() -> None:
    blocked = load("a", (2, 200), head_of_line_demand=900, num_waiting=1)  # F = (1000 - 1100) / 2 = -50
    busy = load("b", (4, 600))  # F = 100
    assert choose(DispatchPolicy.FREENESS, [blocked, busy]) == "b"


def test_infaas_counts_every_queued_request_and_picks_the_least_loaded() -> None:
    # A: 300 used + 500 queued (head of line only 100) = 0.8 of capacity; B: 600 used = 0.6
    a = load("a", (3, 300), head_of_line_demand=100, num_waiting=4, waiting_demand=500)
    b = load("b", (6, 600))
    assert (infaas_load(a), infaas_load(b)) == (0.8, 0.6)
    assert choose(DispatchPolicy.INFAAS, [a, b]) == "b"
    # freeness only sees the head of line: A = (1000 - 400) / 3 = 200 > B = 400 / 6
    assert choose(DispatchPolicy.FREENESS, [a, b]) == "a"
    assert not DispatchPolicy.INFAAS.migrates and DispatchPolicy.FREENESS.migrates


def test_round_robin_cycles_over_eligible_instances_in_id_order() -> None:
    loads = [load("c"), load("a"), load("b"), load("d", terminating=True)]
    dispatcher = make_dispatcher("round_robin")
    request = PendingRequest(request_id="r", num_prompt_tokens=10)
    picks = [dispatcher.choose(request, loads, num_dispatched=n) for n in range(4)]
    assert [p.instance_id for p in picks if p] == ["a", "b", "c", "a"]


def test_ties_break_on_the_smaller_instance_id() -> None:
    loads = [load("b", (1, 100)), load("a", (1, 100)), load("c", (1, 100))]
    for policy in (DispatchPolicy.FREENESS, DispatchPolicy.FREENESS_AFTER_ADMIT, DispatchPolicy.INFAAS):
        assert choose(policy, loads) == "a"


def test_terminating_excluded_and_too_small_instances_are_never_chosen() -> None:
    small = InstanceLoad(instance_id="small", num_total_blocks=10, reported=True)  # 160 tokens at most
    short = InstanceLoad(instance_id="short", num_total_blocks=1000, max_model_len=100, reported=True)
    draining = load("draining", terminating=True)
    fine = load("fine", (9, 900))
    for policy in DispatchPolicy:
        assert choose(policy, [small, short, draining, fine], tokens=200) == "fine"
        assert choose(policy, [small, short, draining, fine], tokens=200, exclude=("fine",)) is None
        assert choose(policy, [], tokens=1) is None


def test_dispatches_not_yet_reported_count_against_the_instance() -> None:
    a, b = load("a"), load("b", (1, 50))  # F: 1000 and 950
    assert load_freeness(a.with_dispatch(100), CONFIG) == 900  # counted as admitted: (1000 - 100) / 1
    requests = [PendingRequest(request_id=f"r{i}", num_prompt_tokens=1600, arrival=i) for i in range(3)]
    result = dispatch_pending(requests, [a, b], make_dispatcher(DispatchPolicy.FREENESS, CONFIG))
    # r0 -> a (1000); then a = 900 < b = 950: r1 -> b; then a = 900 > b = (1000-150)/2: r2 -> a
    assert [d.instance_id for d in result.decisions] == ["a", "b", "a"]
    assert [(ld.num_pending, ld.pending_blocks) for ld in result.loads] == [(2, 200), (1, 100)]
    assert result.unplaced == ()


def test_pending_requests_go_by_priority_then_arrival() -> None:
    late_urgent = PendingRequest(request_id="u", num_prompt_tokens=1, priority=-1, arrival=9.0)
    early = PendingRequest(request_id="e", num_prompt_tokens=1, arrival=1.0)
    later = PendingRequest(request_id="l", num_prompt_tokens=1, arrival=2.0)
    background = PendingRequest(request_id="b", num_prompt_tokens=1, priority=3, arrival=0.0)
    ordered = order_pending([background, later, early, late_urgent])
    assert [r.request_id for r in ordered] == ["u", "e", "l", "b"]
    # the urgent one is served first, so it gets the freest instance
    result = dispatch_pending([early, late_urgent], [load("x", (1, 10)), load("y", (1, 500))],
                              make_dispatcher(DispatchPolicy.FREENESS, CONFIG))
    assert [(d.request_id, d.instance_id) for d in result.decisions] == [("u", "x"), ("e", "y")]


def test_unplaceable_requests_are_returned() -> None:
    result = dispatch_pending([PendingRequest(request_id="big", num_prompt_tokens=10**6)], [load("a")],
                              make_dispatcher(DispatchPolicy.FREENESS_AFTER_ADMIT, CONFIG))
    assert result.decisions == () and [r.request_id for r in result.unplaced] == ["big"]


def test_a_decision_becomes_a_dispatched_event_citing_load_positions() -> None:
    loads = [load("a", stream_seq=7), load("b", (5, 500), stream_seq=9)]
    decision = make_dispatcher("freeness", CONFIG).choose(
        PendingRequest(request_id="r1", num_prompt_tokens=33, priority=2), loads
    )
    assert decision is not None and decision.demand_blocks == 3
    assert decision.to_event(4) == Dispatched(
        epoch=4, request_id="r1", instance_id="a", policy="freeness", num_prompt_tokens=33, priority=2,
        loads=(LoadPosition(instance_id="a", stream_seq=7),),
    )
    assert len(decision.to_event(4, cite_all=True).loads) == 2


def test_make_dispatcher_accepts_values_and_rejects_unknown_names() -> None:
    assert make_dispatcher("infaas++").policy is DispatchPolicy.INFAAS
    assert make_dispatcher(DispatchPolicy.FREENESS_AFTER_ADMIT).policy is DispatchPolicy.FREENESS_AFTER_ADMIT
    with pytest.raises(ValueError):
        make_dispatcher("least-recently-used")


def test_same_inputs_same_decision() -> None:
    loads = [load(f"i{k}", (k % 3 + 1, 37 * k % 400)) for k in range(16)]
    request = PendingRequest(request_id="r", num_prompt_tokens=700)
    for policy in DispatchPolicy:
        dispatcher = make_dispatcher(policy, CONFIG)
        first = dispatcher.choose(request, loads, num_dispatched=5)
        again = dispatcher.choose(request, list(reversed(loads)), num_dispatched=5)
        assert first is not None and again is not None
        assert (first.instance_id, first.score) == (again.instance_id, again.score)
        assert sorted(first.considered) == sorted(again.considered)


def test_queue_aware_sees_the_whole_queue_where_freeness_sees_its_head() -> None:
    # A: 300 used, 4 queued holding 500 blocks of demand (head of line 100): freeness sees
    # (1000 - 400) / 3 = 200 and picks A; shoal's rule sees 500 blocks of prompts ahead of the
    # request at A (-500). B: 6 running, 600 used, no queue: it starts at once, scored by its
    # freeness after admission (1000 - 601) / 7 = 57.
    a = load("a", (3, 300), head_of_line_demand=100, num_waiting=4, waiting_demand=500)
    b = load("b", (6, 600))
    assert queue_aware_score(a, 1, CONFIG) == -500
    assert queue_aware_score(b, 1, CONFIG) == pytest.approx(399 / 7)
    assert choose(DispatchPolicy.FREENESS, [a, b]) == "a"
    assert choose(DispatchPolicy.BLOCKS_AHEAD, [a, b]) == "b"
    assert DispatchPolicy.BLOCKS_AHEAD.migrates


def test_the_superseded_queue_aware_rule_keeps_its_scores_so_its_logs_recompute() -> None:
    """``queue_aware`` still scores as it did: an instance with room scores its freeness after
    admission even with prompts queued ahead, one without room its deficit. ``blocks_ahead``
    scores the queue ahead instead."""
    a = load("a", (3, 300), head_of_line_demand=100, num_waiting=4, waiting_demand=500)
    b = load("b", (6, 600))
    old = queue_aware_score(a, 1, CONFIG, blocks_ahead=False)
    assert old == pytest.approx((1000 - 400 - 400 - 1) / (3 + 4 + 1))  # room 199 over 8 slots
    assert queue_aware_score(a, 1, CONFIG) == -500
    assert choose(DispatchPolicy.QUEUE_AWARE, [a, b]) == "b"  # 199/8 < 399/7
    crowded = load("c", (3, 300), head_of_line_demand=100, num_waiting=4, waiting_demand=1200)
    assert queue_aware_score(crowded, 1, CONFIG, blocks_ahead=False) == -501  # 300 + 1200 + 1 - 1000
    assert DispatchPolicy.QUEUE_AWARE.migrates and DispatchPolicy.QUEUE_AWARE.is_shoal
    from scheduler.policy.dispatch import requeue_choice

    request = PendingRequest(request_id="q", num_prompt_tokens=16)
    assert requeue_choice(
        make_dispatcher(DispatchPolicy.QUEUE_AWARE, CONFIG), request, "a", [a, b], config=CONFIG
    ) is None


def test_queue_aware_ranks_queued_instances_by_work_ahead_in_blocks_not_requests() -> None:
    # A big instance (prefill-bound, memory never binds): both queue. A has 2 long prompts queued
    # (600 blocks), B 6 short ones (120 blocks). Counting requests favours A; the request waits
    # for less prefill work at B.
    a = load("a", (4, 400), total=26000, head_of_line_demand=300, num_waiting=2, waiting_demand=600)
    b = load("b", (4, 400), total=26000, head_of_line_demand=20, num_waiting=6, waiting_demand=120)
    assert (queue_aware_score(a, 1, CONFIG), queue_aware_score(b, 1, CONFIG)) == (-600, -120)
    assert choose(DispatchPolicy.BLOCKS_AHEAD, [a, b]) == "b"
    # a dispatch no report reflects yet is work ahead too (120 + 130 pending = 250 < 600;
    # with 500 pending B has 620 ahead, more than A)
    assert queue_aware_score(b.with_dispatch(130), 1, CONFIG) == -250
    assert choose(DispatchPolicy.BLOCKS_AHEAD, [a, b.with_dispatch(500)]) == "a"


def test_queue_aware_counts_a_memory_deficit_as_work_ahead() -> None:
    # Both queue more than they can hold: A 140 queued and 41 blocks short, B 100 queued and 51
    # short. Divided by the batch, the paper's freeness makes the bigger batch look better
    # (-50 / 10 > -40 / 2); shoal's rule takes the larger bottleneck in blocks: A 140, B 100.
    a = load("a", (2, 900), head_of_line_demand=140, num_waiting=1, waiting_demand=140)
    b = load("b", (10, 950), head_of_line_demand=100, num_waiting=1, waiting_demand=100)
    assert choose(DispatchPolicy.FREENESS, [a, b]) == "b"
    assert queue_aware_score(a, 1, CONFIG) == -140 and queue_aware_score(b, 1, CONFIG) == -100
    assert choose(DispatchPolicy.BLOCKS_AHEAD, [a, b]) == "b"
    # where memory binds harder than the queue, the deficit counts: C is 451 blocks short
    c = load("c", (10, 1350), head_of_line_demand=100, num_waiting=1, waiting_demand=100)
    assert queue_aware_score(c, 1, CONFIG) == -451
    assert choose(DispatchPolicy.BLOCKS_AHEAD, [a, c]) == "a"
    # an instance with no queue but no room for the prompt: the request waits for the deficit
    full = load("f", (2, 990))
    assert queue_aware_score(full, 20, CONFIG) == -10
    # any instance where the request starts at once beats every one where it waits
    d = load("d", (40, 990))
    assert queue_aware_score(d, 1, CONFIG) == pytest.approx(9 / 41)
    assert choose(DispatchPolicy.BLOCKS_AHEAD, [a, b, d]) == "d"
    assert choose(DispatchPolicy.BLOCKS_AHEAD, [a, b.as_terminating()]) == "a"


def test_queue_aware_lets_a_high_priority_request_skip_a_queue_of_normal_ones() -> None:
    # A queues 500 blocks of normal requests behind 300 used; B runs 600 blocks with no queue.
    a = load("a", (3, 300), head_of_line_demand=100, head_of_line_priority=0, num_waiting=4,
             waiting_demand=500)
    b = load("b", (6, 600))
    # a normal request waits behind A's queue (500 blocks ahead, -500); at B it starts at once (57)
    assert choose(DispatchPolicy.BLOCKS_AHEAD, [a, b]) == "b"
    # a high-priority one (lower value) is served before A's queue: (1000 - 301) / 4 = 175 > 57
    assert queue_aware_score(a, 1, CONFIG, priority=-1) == pytest.approx(699 / 4)
    assert choose(DispatchPolicy.BLOCKS_AHEAD, [a, b], priority=-1) == "a"


def test_a_queued_request_moves_only_where_it_would_start_at_once() -> None:
    from scheduler.policy.dispatch import requeue_choice

    request = PendingRequest(request_id="q", num_prompt_tokens=160)  # 10 blocks
    stalled = load("s", (5, 990), head_of_line_demand=50, num_waiting=3, waiting_demand=80)
    busy = load("b", (4, 950), head_of_line_demand=40, num_waiting=1, waiting_demand=40)
    free = load("f", (4, 600))
    queue_aware = make_dispatcher(DispatchPolicy.BLOCKS_AHEAD, CONFIG)
    decision = requeue_choice(queue_aware, request, "s", [stalled, busy, free], config=CONFIG)
    assert decision is not None and decision.instance_id == "f" and decision.score >= 0
    # where it would wait anyway it stays (no churn between queues), and never goes back to itself
    assert requeue_choice(queue_aware, request, "s", [stalled, busy], config=CONFIG) is None
    assert requeue_choice(queue_aware, request, "f", [free], config=CONFIG) is None
    # only shoal's dispatch says "starts at once"
    infaas = make_dispatcher(DispatchPolicy.INFAAS, CONFIG)
    assert requeue_choice(infaas, request, "s", [stalled, busy, free], config=CONFIG) is None


def test_prefill_ahead_counts_the_prompts_in_flight_as_work_ahead() -> None:
    # ``a`` has more room but is prefilling 300 blocks of prompts admitted in the step in flight (an
    # unchunked engine computes them all before its next step); ``b`` only decodes.
    a = load("a", (3, 400), prefill_blocks=300)
    b = load("b", (6, 600))
    # blocks_ahead sees nothing queued on either and picks the most room per request: ``a``, where the
    # request waits for the whole step in flight
    assert choose(DispatchPolicy.BLOCKS_AHEAD, [a, b]) == "a"
    # prefill_ahead: ``a`` has 300 blocks of prefill ahead of the request, ``b`` none
    assert queue_aware_score(a, 1, CONFIG, count_prefill=True) == -300
    assert queue_aware_score(b, 1, CONFIG, count_prefill=True) == pytest.approx(399 / 7)
    assert choose(DispatchPolicy.PREFILL_AHEAD, [a, b]) == "b"
    # once both prefill, the least work ahead (in flight + queued + pending) wins
    c = load("c", (6, 600), prefill_blocks=100, head_of_line_demand=50, num_waiting=2, waiting_demand=150)
    assert queue_aware_score(c, 1, CONFIG, count_prefill=True) == -250
    assert choose(DispatchPolicy.PREFILL_AHEAD, [a, c]) == "c"
    assert choose(DispatchPolicy.PREFILL_AHEAD, [a, c.with_dispatch(60)]) == "a"  # 310 ahead of it now
    # where memory binds the request waits for blocks to be freed, not for the prompts in flight
    # (they are computed long before): the deficit, as under blocks_ahead
    full = load("f", (6, 990), prefill_blocks=100)
    assert queue_aware_score(full, 5, CONFIG, count_prefill=True) == -100  # room 5: the prefill ahead
    assert queue_aware_score(full, 20, CONFIG, count_prefill=True) == -10  # deficit 10
    assert queue_aware_score(full, 50, CONFIG, count_prefill=True) == -40  # deficit 40
    assert queue_aware_score(full, 20, CONFIG) == -10


def test_prefill_ahead_moves_a_queued_request_where_it_starts_at_once_least_prefill_first() -> None:
    from scheduler.policy.dispatch import requeue_choice, requeue_request

    config = PolicyConfig(dispatch_policy=DispatchPolicy.PREFILL_AHEAD)
    request = PendingRequest(request_id="q", num_prompt_tokens=160)  # 10 blocks
    stalled = load("s", (5, 990), head_of_line_demand=50, num_waiting=3, waiting_demand=80)
    busy = load("b", (4, 950), head_of_line_demand=40, num_waiting=1, waiting_demand=40)
    prefilling = load("p", (2, 300), prefill_blocks=200)  # starts at once, behind a prefill in flight
    decoding = load("d", (8, 700))  # starts at once, nothing in flight
    dispatcher = make_dispatcher(DispatchPolicy.PREFILL_AHEAD, config)
    loads = [stalled, busy, prefilling, decoding]
    decision = requeue_choice(dispatcher, request, "s", loads, config=config)
    assert decision is not None and decision.instance_id == "d"
    # where it would wait for memory or a queue it is never moved; behind a prefill it may be
    assert requeue_request(request, "s", loads, config).exclude == ("s", "b")
    decision = requeue_choice(dispatcher, request, "s", [stalled, busy, prefilling], config=config)
    assert decision is not None and decision.instance_id == "p" and decision.score == -200
    assert requeue_choice(dispatcher, request, "s", [stalled, busy], config=config) is None


def test_prefill_ahead_saturated_goes_by_memory_once_the_request_waits_for_it_everywhere() -> None:
    # A is 41 blocks short with 140 queued, B 51 short with 100 queued: prefill_ahead takes the
    # shorter queue (B), INFaaS++ the least memory load (A: 1.04 of capacity against 1.05)
    a = load("a", (2, 900), head_of_line_demand=140, num_waiting=1, waiting_demand=140)
    b = load("b", (10, 950), head_of_line_demand=100, num_waiting=1, waiting_demand=100)
    assert choose(DispatchPolicy.PREFILL_AHEAD, [a, b]) == "b"
    assert choose(DispatchPolicy.INFAAS, [a, b]) == "a"
    assert choose(DispatchPolicy.PREFILL_AHEAD_SATURATED, [a, b]) == "a"
    request = PendingRequest(request_id="r", num_prompt_tokens=16)
    decision = make_dispatcher(DispatchPolicy.PREFILL_AHEAD_SATURATED, CONFIG).choose(request, [a, b])
    assert decision is not None and decision.to_event(0).policy == "prefill_ahead_saturated"
    # where the request has room somewhere (only a queue ahead of it there, or nothing), the rule is
    # prefill_ahead's
    queued = load("q", (2, 100), head_of_line_demand=50, num_waiting=1, waiting_demand=50)
    free = load("d", (40, 500))
    for loads in ([a, b, queued], [a, b, free], [a, b, queued, free]):
        saturated = choose(DispatchPolicy.PREFILL_AHEAD_SATURATED, loads)
        assert saturated == choose(DispatchPolicy.PREFILL_AHEAD, loads)
    assert choose(DispatchPolicy.PREFILL_AHEAD_SATURATED, [a, b, queued]) == "q"
    # excluded and terminating instances do not count as waiting
    assert choose(DispatchPolicy.PREFILL_AHEAD_SATURATED, [a, b, free], exclude=("d",)) == "a"
    assert choose(DispatchPolicy.PREFILL_AHEAD_SATURATED, [a, b, free.as_terminating()]) == "a"
