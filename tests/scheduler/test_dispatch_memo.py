"""A dispatcher kept across decisions (scores memoised per instance view) decides as a fresh one does."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.config import DispatchPolicy, PolicyConfig
from scheduler.policy import InstanceLoad, PendingRequest, make_dispatcher
from schemas.load import PriorityLoad

CONFIG = PolicyConfig()


def _load(instance_id: str, running: int, blocks: int, waiting: int, head: int) -> InstanceLoad:
    return InstanceLoad(
        instance_id=instance_id,
        max_model_len=1000 if instance_id in ("i1", "i5") else 8192,
        num_total_blocks=1000,
        reported=True,
        running=(PriorityLoad(priority=0, num_running=running, num_blocks=blocks),),
        num_waiting=waiting,
        head_of_line_demand=head,
        waiting_demand=head * waiting,
        head_of_line_priority=0,
    )


def test_a_kept_dispatcher_rescores_an_instance_whose_view_changed() -> None:
    dispatcher = make_dispatcher(DispatchPolicy.BLOCKS_AHEAD, CONFIG)
    request = PendingRequest(request_id="r", num_prompt_tokens=160)
    a, b = _load("a", 1, 100, 0, 0), _load("b", 4, 400, 0, 0)
    decision = dispatcher.choose(request, [a, b])
    assert decision is not None and decision.instance_id == "a"
    # a fills up and queues: the same dispatcher must see it, not a's old score
    a_full = _load("a", 30, 990, 2, 40)
    decision = dispatcher.choose(request, [a_full, b])
    assert decision is not None and decision.instance_id == "b"
    # ... and a dispatch to b that no report reflects yet counts against b at once
    fresh = make_dispatcher(DispatchPolicy.BLOCKS_AHEAD, CONFIG)
    b_busy = b
    for _ in range(40):
        b_busy = b_busy.with_dispatch(10)
    kept_choice = dispatcher.choose(request, [a, b_busy])
    assert kept_choice == fresh.choose(request, [a, b_busy])


_change = st.tuples(
    st.integers(0, 7),  # which instance
    st.sampled_from(("report", "dispatch", "leave", "none")),
    st.integers(0, 40),
    st.integers(0, 1000),
    st.integers(0, 3),
    st.integers(0, 80),
)
_request = st.tuples(
    st.sampled_from((16, 128, 150, 160, 700, 1000, 1001, 4000)),  # 150/160, 1000/1001: same blocks
    st.sampled_from((0, 1, -1)),
    st.sampled_from(((), ("i0",), ("i1", "i2"))),
)


@settings(max_examples=80, deadline=None)
@given(
    policy=st.sampled_from(list(DispatchPolicy)),
    steps=st.lists(st.tuples(_change, st.lists(_request, min_size=1, max_size=4)), min_size=1, max_size=30),
)
def test_a_kept_dispatcher_decides_what_a_fresh_one_decides(
    policy: DispatchPolicy,
    steps: list[tuple[tuple[int, str, int, int, int, int], list[tuple[int, int, tuple[str, ...]]]]],
) -> None:
    kept = make_dispatcher(policy, CONFIG)
    views = {f"i{k}": _load(f"i{k}", k, 50 * k, 0, 0) for k in range(8)}
    for number, ((index, kind, running, blocks, waiting, head), asks) in enumerate(steps):
        instance_id = f"i{index}"
        if kind == "report":
            views[instance_id] = _load(instance_id, running, blocks, waiting, head)
        elif kind == "dispatch" and instance_id in views:
            views[instance_id] = views[instance_id].with_dispatch(head)
        elif kind == "leave":
            views.pop(instance_id, None)
        loads = [views[key] for key in sorted(views)]
        # several requests over the same views: the memo must tell them apart
        requests = [
            PendingRequest(request_id=f"r{number}", num_prompt_tokens=t, priority=p, exclude=x)
            for t, p, x in asks
        ]
        expected = [make_dispatcher(policy, CONFIG).choose(r, loads, num_dispatched=number) for r in requests]
        assert [kept.choose(r, loads, num_dispatched=number) for r in requests] == expected
        # equal views that are other objects are rated afresh, with the same results
        copies = [msgspec.structs.replace(load) for load in loads]
        assert [kept.choose(r, copies, num_dispatched=number) for r in requests] == expected


def test_a_kept_dispatcher_tells_priorities_apart_on_the_same_views() -> None:
    # a has room but a queue of normal-priority prompts; b is busier with nothing queued
    a, b = _load("a", 2, 100, 3, 40), _load("b", 20, 600, 0, 0)
    normal = PendingRequest(request_id="n", num_prompt_tokens=160)
    high = PendingRequest(request_id="h", num_prompt_tokens=160, priority=-1)
    kept = make_dispatcher(DispatchPolicy.BLOCKS_AHEAD, CONFIG)
    fresh = [make_dispatcher(DispatchPolicy.BLOCKS_AHEAD, CONFIG).choose(r, [a, b]) for r in (normal, high)]
    assert [d.instance_id for d in fresh if d is not None] == ["b", "a"]  # the high one skips a's queue
    assert [kept.choose(r, [a, b]) for r in (normal, high, normal)] == [*fresh, fresh[0]]


def test_prompts_of_the_same_demand_differ_where_one_exceeds_the_model_length() -> None:
    # 1000 and 1001 tokens both need 63 blocks; only the first fits a's model length
    a = msgspec.structs.replace(_load("a", 0, 0, 0, 0), max_model_len=1000)
    b = _load("b", 20, 600, 0, 0)
    fits, too_long = (PendingRequest(request_id=str(n), num_prompt_tokens=n) for n in (1000, 1001))
    kept = make_dispatcher(DispatchPolicy.BLOCKS_AHEAD, CONFIG)
    chosen = [kept.choose(r, [a, b]) for r in (fits, too_long, fits)]
    assert [d.instance_id for d in chosen if d is not None] == ["a", "b", "a"]
