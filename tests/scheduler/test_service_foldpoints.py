"""Fold points (pure): a scheduler's shadow reaches the same state whatever order the streams arrive in."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cluster_state import encode_snapshot, initial_state
from scheduler.config import PolicyConfig
from scheduler.follower import LogFollower, Shadow
from scheduler.recompute import Cursor, apply_overlay, dispatch_decision
from schemas.decisions import Dispatched, SchedulerTick
from schemas.envelope import Body
from schemas.load import LoadReport
from schemas.rpc import DispatchRequest
from tests.scheduler.events import EVENTS, LOADS, joined, report


def _live_log(seed: int) -> tuple[list[tuple[int, Body]], list[tuple[int, LoadReport]]]:
    """A log written the way the live scheduler writes it: decisions over the fold point plus own overlay."""
    rng = random.Random(seed)
    events: list[tuple[int, Body]] = [(1, SchedulerTick(epoch=1, takeover=True))]
    events += [(k + 2, joined(f"i{k}", num_blocks=200)) for k in range(3)]
    loads: list[tuple[int, LoadReport]] = []
    follower = LogFollower(initial_state(gapless_streams=(EVENTS,)), events_stream=EVENTS, loads_stream=LOADS)
    for seq, body in events:
        follower.add_event(seq, body)
    own: list[tuple[int, Body]] = [events[0]]
    accepted = dict.fromkeys(["i0", "i1", "i2"], 0)
    report_seq = dict.fromkeys(accepted, 0)
    for step in range(60):
        if rng.random() < 0.5:
            instance = rng.choice(sorted(accepted))
            accepted[instance] += rng.randint(0, 2)
            report_seq[instance] += 1
            running = ((0, rng.randint(0, 5), rng.randint(0, 150)),)
            body = report(
                instance, report_seq[instance], running=running, accepted=accepted[instance], total=200
            )
            loads.append((len(loads) + 1, body))
            follower.add_load(len(loads), body)
            continue
        state, cursor = follower.preview()  # a dispatch folds what arrived since the last fold point
        follower.commit(state, cursor)
        own = [(s, b) for s, b in own if s > cursor.events_seq]
        view = apply_overlay(follower.state, [b for _, b in own])
        request = DispatchRequest(request_id=f"r{step}", num_prompt_tokens=rng.randint(1, 200))
        decision = dispatch_decision(view, request, epoch=1, cursor=follower.cursor, policy=_policy())
        assert decision is not None
        seq = len(events) + 1
        events.append((seq, decision))
        follower.add_event(seq, decision)
        own.append((seq, decision))
    return events, loads


def _policy() -> PolicyConfig:
    return PolicyConfig()


def _shadow_state(
    events: list[tuple[int, Body]], loads: list[tuple[int, LoadReport]], order: list[bool]
) -> bytes:
    shadow = Shadow(
        LogFollower(initial_state(gapless_streams=(EVENTS,)), events_stream=EVENTS, loads_stream=LOADS),
        verify=True,
    )
    ev, ld = iter(events), iter(loads)
    for take_event in order:
        if take_event:
            seq, body = next(ev)
            shadow.on_event(seq, body)
        else:
            seq, report_body = next(ld)
            shadow.on_load(seq, report_body)
        shadow.advance()
    assert shadow.mismatches == []
    shadow.follower.fold_to(Cursor(events[-1][0], loads[-1][0] if loads else 0))
    return encode_snapshot(shadow.follower.state)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), shuffle=st.integers(0, 10_000))
def test_shadow_state_and_verdicts_do_not_depend_on_arrival_interleaving(seed: int, shuffle: int) -> None:
    events, loads = _live_log(seed)
    order = [True] * len(events) + [False] * len(loads)
    baseline = _shadow_state(events, loads, order)
    random.Random(shuffle).shuffle(order)
    assert _shadow_state(events, loads, order) == baseline


def test_a_decision_made_from_another_state_is_reported_as_a_mismatch() -> None:
    events, loads = _live_log(7)
    index = next(i for i, (_, b) in enumerate(events) if isinstance(b, Dispatched) and b.instance_id == "i0")
    seq, body = events[index]
    assert isinstance(body, Dispatched)
    events[index] = (
        seq,
        Dispatched(**{**{f: getattr(body, f) for f in body.__struct_fields__}, "instance_id": "i2"}),
    )
    shadow = Shadow(
        LogFollower(initial_state(gapless_streams=(EVENTS,)), events_stream=EVENTS, loads_stream=LOADS),
        verify=True,
    )
    for seq_, report_body in loads:
        shadow.on_load(seq_, report_body)
    for seq_, event in events:
        shadow.on_event(seq_, event)
        shadow.advance()
    assert [m.seq for m in shadow.mismatches][:1] == [seq]
