"""The local scheduler: admission order, rejection, stop rules, preemption; properties over random loads."""

from __future__ import annotations

import random

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from agents.engines.local_scheduler import LocalScheduler, LocalSchedulerConfig, SchedulerOutput
from agents.engines.protocol import (
    FinishReason,
    InvalidRequestState,
    PreemptionEvent,
    RejectionEvent,
    RejectReason,
    RequestOutput,
    RequestRejected,
    RequestStatus,
)
from schemas import SamplingParams

EOS = 0


def make(num_blocks: int = 16, block_size: int = 4, **kw: int | None) -> LocalScheduler:
    config = LocalSchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=kw.pop("max_model_len", None) or 1024,
        vocab_size=100,
        eos_token_id=EOS,
        **kw,  # type: ignore[arg-type]
    )
    return LocalScheduler(config)


def run_step(sched: LocalScheduler, token: int = 7) -> tuple[SchedulerOutput, list[RequestOutput]]:
    plan = sched.schedule()
    ids = [p.request.request_id for p in plan.prefills] + [r.request_id for r in plan.decodes]
    return plan, sched.update_from_output(plan, dict.fromkeys(ids, token))


def sp(max_tokens: int = 8, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- admission


def test_queue_admits_by_priority_then_arrival_while_the_head_fits() -> None:
    sched = make(num_blocks=6, block_size=4)
    sched.add_request("old-low", [1] * 8, sp(), priority=0)  # 2 blocks
    sched.add_request("new-low", [1] * 4, sp(), priority=0)  # 1 block
    sched.add_request("high", [1] * 12, sp(), priority=-1)  # 3 blocks
    plan, _ = run_step(sched)
    assert [p.request.request_id for p in plan.prefills] == ["high", "old-low", "new-low"]
    assert [(p.start, p.end) for p in plan.prefills] == [(0, 12), (0, 8), (0, 4)]
    assert sched.blocks.num_free_blocks == 0


def test_a_head_that_does_not_fit_blocks_the_queue_behind_it() -> None:
    sched = make(num_blocks=4, block_size=4)
    sched.add_request("a", [1] * 8, sp(max_tokens=100))
    run_step(sched)
    sched.add_request("big", [1] * 12, sp())  # needs 3, 2 free
    sched.add_request("small", [1] * 2, sp())  # would fit, but waits its turn (FCFS)
    plan, _ = run_step(sched)
    assert plan.prefills == []
    stats = sched.stats()
    assert stats.num_waiting == 2
    assert stats.head_of_line_demand == 3


def test_batch_size_limit_holds_requests_in_the_queue() -> None:
    sched = make(num_blocks=64, max_batch_size=2)
    for i in range(3):
        sched.add_request(f"r{i}", [1, 2], sp())
    plan, _ = run_step(sched)
    assert len(plan.prefills) == 2
    assert sched.num_running == 2 and sched.num_waiting == 1


def test_prefill_token_budget_admits_at_least_one_prompt() -> None:
    sched = make(num_blocks=64, max_prefill_tokens=10)
    sched.add_request("long", [1] * 30, sp())
    sched.add_request("short", [1] * 4, sp())
    plan, _ = run_step(sched)
    assert [p.request.request_id for p in plan.prefills] == ["long"]
    plan, _ = run_step(sched)
    assert [p.request.request_id for p in plan.prefills] == ["short"]


def test_chunked_prefill_spreads_a_long_prompt_over_steps_beside_the_decodes() -> None:
    sched = make(num_blocks=64, max_step_tokens=12)
    sched.add_request("short", [1] * 3, sp(max_tokens=20))
    run_step(sched)  # "short" now decodes
    sched.add_request("long", [1] * 40, sp(max_tokens=2))
    chunks: list[tuple[int, int, bool]] = []
    first_token_step = None
    for step in range(8):
        plan, outs = run_step(sched)
        assert "short" in [r.request_id for r in plan.decodes]  # decoding never waits for the prompt
        assert plan.num_prefill_tokens + len(plan.decodes) <= 12
        chunks += [(p.start, p.end, p.final) for p in plan.prefills]
        if first_token_step is None and any(o.request_id == "long" for o in outs):
            first_token_step = step
    # 11 prompt tokens per step after the decode's one; the last chunk samples the first token
    assert chunks[:4] == [(0, 11, False), (11, 22, False), (22, 33, False), (33, 40, True)]
    assert first_token_step == 3
    assert chunks[4:] == []  # then it decodes (max_tokens=2: one decode, done)


def test_chunked_prefill_budget_leaves_a_block_for_prompts_under_many_decodes() -> None:
    sched = make(num_blocks=64, max_step_tokens=4, block_size=4)
    for i in range(6):
        sched.add_request(f"d{i}", [1], sp(max_tokens=50))
    plan, _ = run_step(sched)
    assert len(plan.prefills) == 4  # admission stops where the budget ends
    run_step(sched)
    sched.add_request("p", [1] * 10, sp())
    plan, _ = run_step(sched)
    assert len(plan.decodes) == 6  # more decodes than the budget: prompts still get a block's worth
    assert [(p.request.request_id, p.num_tokens) for p in plan.prefills] == [("p", 4)]


def test_abort_of_a_request_in_the_middle_of_its_chunked_prefill_frees_everything() -> None:
    sched = make(num_blocks=16, block_size=4, max_step_tokens=8)
    sched.add_request("long", [1] * 30, sp())
    plan = sched.schedule()
    assert [(p.start, p.end, p.final) for p in plan.prefills] == [(0, 8, False)]
    assert sched.abort("long")
    assert sched.update_from_output(plan, {}) == []
    assert sched.blocks.num_free_blocks == 16 and not sched.has_unfinished()


def test_adding_the_same_id_twice_is_a_no_op() -> None:
    sched = make()
    assert sched.add_request("r", [1, 2, 3], sp()) is True
    assert sched.add_request("r", [9] * 50, sp(max_tokens=1)) is False
    assert sched.request("r").prompt_token_ids == (1, 2, 3)
    assert sched.num_waiting == 1


# ---------------------------------------------------------------- rejection


@pytest.mark.parametrize(
    ("prompt", "sampling", "reason"),
    [
        ([], sp(), RejectReason.EMPTY_PROMPT),
        ([1, 100], sp(), RejectReason.TOKEN_OUT_OF_RANGE),
        ([-1], sp(), RejectReason.TOKEN_OUT_OF_RANGE),
        ([1] * 65, sp(), RejectReason.EXCEEDS_CAPACITY),  # 16 blocks of 4 = 64 tokens
        ([1] * 10, sp(max_tokens=-1), RejectReason.INVALID_SAMPLING),
        ([1] * 10, sp(min_tokens=-1), RejectReason.INVALID_SAMPLING),
    ],
)
def test_bad_requests_are_rejected_counted_and_leave_others_alone(
    prompt: list[int], sampling: SamplingParams, reason: RejectReason
) -> None:
    sched = make(num_blocks=16, block_size=4)
    sched.add_request("good", [1, 2], sp(max_tokens=2))
    with pytest.raises(RequestRejected) as info:
        sched.add_request("bad", prompt, sampling)
    assert info.value.reason is reason
    assert "bad" in str(info.value)
    assert "bad" not in sched
    assert sched.stats().num_rejections == 1
    assert sched.take_events() == [RejectionEvent("bad", reason, info.value.detail)]
    finished = []
    while sched.has_unfinished():
        finished += [o.request_id for o in run_step(sched)[1] if o.finished]
    assert finished == ["good"]


def test_prompt_longer_than_the_model_context_is_rejected() -> None:
    sched = make(num_blocks=1000, max_model_len=32)
    with pytest.raises(RequestRejected) as info:
        sched.add_request("r", [1] * 33, sp())
    assert info.value.reason is RejectReason.EXCEEDS_MODEL_CONTEXT
    sched.add_request("fits", [1] * 32, sp())


# ---------------------------------------------------------------- stop rules


def generate(sched: LocalScheduler, request_id: str, tokens: list[int]) -> list[RequestOutput]:
    """Feed ``tokens`` as the sampled tokens of ``request_id``, one per step, until it finishes."""
    outputs: list[RequestOutput] = []
    for token in tokens:
        outputs += [o for o in run_step(sched, token)[1] if o.request_id == request_id]
        if outputs and outputs[-1].finished:
            break
    return outputs


def test_max_tokens_finishes_with_length() -> None:
    sched = make()
    sched.add_request("r", [1, 2, 3], sp(max_tokens=3))
    outs = generate(sched, "r", [5] * 10)
    assert [(o.first_index, o.token_ids, o.finish_reason) for o in outs] == [
        (0, (5,), None),
        (1, (5,), None),
        (2, (5,), "length"),
    ]
    assert outs[0].num_prompt_tokens == 3
    assert not sched.has_unfinished()
    assert sched.blocks.num_free_blocks == 16


def test_eos_stops_unless_ignored_or_before_min_tokens() -> None:
    sched = make()
    sched.add_request("plain", [1], sp())
    assert [o.finish_reason for o in generate(sched, "plain", [5, EOS])] == [None, "stop"]
    sched.add_request("min", [1], sp(min_tokens=3))
    assert [o.finish_reason for o in generate(sched, "min", [EOS, EOS, EOS])] == [None, None, "stop"]
    sched.add_request("ignore", [1], sp(max_tokens=3, ignore_eos=True))
    assert [o.finish_reason for o in generate(sched, "ignore", [EOS] * 5)] == [None, None, "length"]


def test_stop_token_ids_stop() -> None:
    sched = make()
    sched.add_request("r", [1], sp(stop_token_ids=(42, 43)))
    assert [o.finish_reason for o in generate(sched, "r", [5, 43, 5])] == [None, "stop"]


def test_model_context_caps_generation() -> None:
    sched = make(num_blocks=100, max_model_len=6)
    sched.add_request("r", [1, 2, 3, 4], sp(max_tokens=100))
    outs = generate(sched, "r", [5] * 10)
    assert [o.finish_reason for o in outs] == [None, "length"]  # 4 + 2 = 6 tokens


def test_instance_capacity_caps_generation_instead_of_thrashing() -> None:
    sched = make(num_blocks=2, block_size=4)  # 8 tokens of KV
    sched.add_request("r", [1] * 6, sp(max_tokens=100))
    outs = generate(sched, "r", [5] * 10)
    # 9 tokens is the longest sequence whose next decode still fits: KV for 8 tokens.
    assert len(outs) == 3 and outs[-1].finish_reason is FinishReason.LENGTH
    assert sched.num_preemptions == 0


# ---------------------------------------------------------------- preemption


def test_preemption_picks_the_newest_lowest_priority_and_recomputes_it() -> None:
    sched = make(num_blocks=4, block_size=2)
    sched.add_request("hi", [1, 2], sp(max_tokens=50), priority=-1)
    sched.add_request("old", [1, 2], sp(max_tokens=50))
    sched.add_request("new", [1, 2], sp(max_tokens=50))
    run_step(sched)  # 3 prefills: 3 blocks used
    run_step(sched)  # each needs a 2nd block: 1 free -> "hi" grows, then "new" is preempted for "old"
    events = sched.take_events()
    assert [e.request_id for e in events if isinstance(e, PreemptionEvent)] == ["new"]
    new = sched.request("new")
    assert new.status is RequestStatus.PREEMPTED
    assert new.block_ids == [] and new.num_preemptions == 1
    assert new.output_token_ids == (7,)  # kept, recomputed with the prompt when re-admitted
    while sched.request("new").status is not RequestStatus.RUNNING:
        plan, outs = run_step(sched)
    recompute = [p for p in plan.prefills if p.request.request_id == "new"]
    assert [(p.start, p.end) for p in recompute] == [(0, 3)]
    assert [o.first_index for o in outs if o.request_id == "new"] == [1]


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_lowest() -> None:
    sched = make(num_blocks=3, block_size=2)
    sched.add_request("hi", [1, 2, 3, 4], sp(max_tokens=50), priority=-1)
    sched.add_request("lo", [1, 2], sp(max_tokens=50))
    run_step(sched)
    plan, _ = run_step(sched)  # hi holds 2, lo holds 1; hi (5 tokens) needs a 3rd: lo goes
    assert plan.preempted == ["lo"]
    assert [r.request_id for r in plan.decodes] == ["hi"]


def test_suspended_requests_keep_blocks_and_sit_out() -> None:
    sched = make()
    sched.add_request("r", [1, 2], sp(max_tokens=50))
    sched.add_request("s", [1, 2], sp(max_tokens=50))
    run_step(sched)
    sched.suspend("s")
    blocks = list(sched.request("s").block_ids)
    for _ in range(3):
        plan, _ = run_step(sched)
        assert [r.request_id for r in plan.decodes] == ["r"]
    assert sched.request("s").block_ids == blocks
    assert sched.stats().num_suspended == 1
    sched.resume("s")
    plan, _ = run_step(sched)
    assert {r.request_id for r in plan.decodes} == {"r", "s"}
    sched.add_request("w", [1], sp())
    sched.request("w").status = RequestStatus.PREEMPTED  # queued again after it ran: it has KV to redo
    with pytest.raises(InvalidRequestState):
        sched.suspend("w")


def test_a_queued_request_is_held_out_of_the_queue_and_resumes_in_its_place() -> None:
    # a request that never ran (no KV) is held for a move without KV; resumed, it keeps its turn
    sched = make(num_blocks=4, block_size=4)
    sched.add_request("big", [1] * 16, sp(max_tokens=2))  # takes every block for two steps
    sched.add_request("a", [1, 2], sp())
    sched.add_request("b", [1, 2], sp())
    run_step(sched)
    sched.suspend("a")
    assert sched.request("a").status is RequestStatus.SUSPENDED and sched.request("a").block_ids == []
    stats = sched.stats()
    assert stats.num_waiting == 1 and stats.num_suspended == 1 and stats.head_of_line_demand == 1
    sched.resume("a")
    assert [r.request_id for r in sched.waiting_requests()] == ["a", "b"]
    sched.suspend("b")
    while "big" in sched:
        run_step(sched)
    plan, _ = run_step(sched)  # a is admitted, b is held
    assert [p.request.request_id for p in plan.prefills] == ["a"]
    assert sched.release_request("b") == 0 and "b" not in sched
    assert sched.stats().num_suspended == 0 and sched.num_waiting == 0


def test_abort_between_schedule_and_update_drops_the_output() -> None:
    sched = make()
    sched.add_request("a", [1, 2], sp())
    sched.add_request("b", [1, 2], sp())
    plan = sched.schedule()
    assert sched.abort("a") is True
    assert sched.abort("a") is False
    outs = sched.update_from_output(plan, {"a": 5, "b": 5})
    assert [o.request_id for o in outs] == ["b"]
    assert sched.blocks.num_allocated_blocks == len(sched.request("b").block_ids)


# ---------------------------------------------------------------- priority rules (opt-in)


def _two_normals_running(**kw: int | bool | None) -> LocalScheduler:
    sched = make(num_blocks=4, block_size=4, **kw)  # type: ignore[arg-type]
    sched.add_request("old", [1] * 7, sp(max_tokens=50))  # 2 blocks, its 8th token fits
    sched.add_request("new", [1] * 3, sp(max_tokens=50))  # 1 block
    run_step(sched)
    assert sched.blocks.num_free_blocks == 1
    return sched


def test_without_priority_preemption_a_high_request_waits_for_memory() -> None:
    sched = _two_normals_running()
    sched.add_request("high", [1] * 8, sp(), priority=-1)  # 2 blocks, 1 free
    plan, _ = run_step(sched)
    assert plan.prefills == [] and plan.preempted == []
    assert sched.request("high").status is RequestStatus.WAITING


def test_priority_preemption_admits_a_high_request_by_preempting_the_newest_worse_one() -> None:
    sched = _two_normals_running(priority_preemption=True)
    sched.add_request("high", [1] * 8, sp(), priority=-1)
    plan, outs = run_step(sched)
    assert plan.preempted == ["new"]
    assert [p.request.request_id for p in plan.prefills] == ["high"]
    assert [r.request_id for r in plan.decodes] == ["old"]  # the victim left this step's plan
    assert {o.request_id for o in outs} == {"high", "old"}
    assert sched.request("new").status is RequestStatus.PREEMPTED
    events = [e for e in sched.take_events() if isinstance(e, PreemptionEvent)]
    assert [e.request_id for e in events] == ["new"]


def test_priority_preemption_preempts_nothing_when_it_cannot_make_room() -> None:
    sched = _two_normals_running(priority_preemption=True)
    sched.add_request("same", [1] * 8, sp())  # normal too: no worse request to preempt
    sched.add_request("huge", [1] * 16, sp(), priority=-1)  # 4 blocks: the normals' 3 + 1 free
    plan, _ = run_step(sched)
    assert plan.preempted == ["new", "old"]  # together they make room
    assert [p.request.request_id for p in plan.prefills] == ["huge"]
    sched2 = make(num_blocks=4, block_size=4, priority_preemption=True)  # type: ignore[arg-type]
    sched2.add_request("normal", [1] * 7, sp(max_tokens=50))  # 2 blocks
    sched2.add_request("high-running", [1] * 3, sp(max_tokens=50), priority=-1)  # 1 block
    run_step(sched2)
    sched2.add_request("high-big", [1] * 16, sp(), priority=-1)  # 4 blocks: 1 free + 2 worse
    plan, _ = run_step(sched2)
    assert plan.preempted == [] and plan.prefills == []  # preempting "normal" would not do
    assert {r.request_id for r in plan.decodes} == {"normal", "high-running"}


def test_prompts_by_priority_prefills_a_high_prompt_without_normal_ones() -> None:
    for rule, expected in ((False, [["high", "a", "b"]]), (True, [["high"], ["a", "b"]])):
        sched = make(num_blocks=16, block_size=4, prompts_by_priority=rule)  # type: ignore[arg-type]
        sched.add_request("a", [1] * 4, sp(max_tokens=5))
        sched.add_request("b", [1] * 4, sp(max_tokens=5))
        sched.add_request("high", [1] * 8, sp(max_tokens=5), priority=-1)
        admitted = []
        for _ in expected:
            plan, _ = run_step(sched)
            admitted.append([p.request.request_id for p in plan.prefills])
        assert admitted == expected


def test_high_priority_reserve_keeps_free_blocks_once_a_high_request_was_seen() -> None:
    sched = make(num_blocks=8, block_size=4, high_priority_reserve_blocks=3)  # type: ignore[arg-type]
    sched.add_request("n1", [1] * 16, sp(max_tokens=2))  # 4 blocks: fits, no high seen yet
    plan, _ = run_step(sched)
    assert [p.request.request_id for p in plan.prefills] == ["n1"]
    sched.add_request("h", [1] * 4, sp(max_tokens=50), priority=-1)
    sched.add_request("n2", [1] * 4, sp(max_tokens=50))  # 1 block, but 4 free - 3 kept: it waits
    plan, _ = run_step(sched)
    assert [p.request.request_id for p in plan.prefills] == ["h"]
    plan, _ = run_step(sched)  # n1 finished: 7 free, n2 takes 1 of the 4 above the reserve
    assert [p.request.request_id for p in plan.prefills] == ["n2"]


# ---------------------------------------------------------------- properties


@st.composite
def workloads(draw: st.DrawFn) -> dict[str, object]:
    num_requests = draw(st.integers(1, 30))
    return {
        "num_blocks": draw(st.integers(4, 32)),
        "block_size": draw(st.sampled_from([1, 2, 4, 16])),
        "max_batch_size": draw(st.integers(1, 12)),
        "requests": [
            (
                draw(st.integers(0, 12)),  # arrival step
                draw(st.integers(1, 40)),  # prompt length
                draw(st.integers(1, 60)),  # max_tokens
                draw(st.integers(0, 2)),  # priority
            )
            for _ in range(num_requests)
        ],
        "seed": draw(st.integers(0, 2**16)),
        "abort_some": draw(st.booleans()),
        "reserve_some": draw(st.booleans()),
        "suspend_some": draw(st.booleans()),
        "max_step_tokens": draw(st.sampled_from([None, 1, 5, 16])),
    }


@settings(max_examples=120, deadline=None)
@given(workloads())
def test_random_loads_respect_capacity_preempt_only_when_needed_and_all_finish(w: dict) -> None:  # type: ignore[type-arg]
    sched = check_load(w)
    event(f"preempted: {sched.num_preemptions > 0}")


@settings(max_examples=60, deadline=None)
@given(workloads(), st.integers(0, 6))
def test_random_loads_with_the_priority_rules_keep_capacity_and_all_finish(w: dict, reserve: int) -> None:  # type: ignore[type-arg]
    w["rules"] = {"priority_preemption": True, "prompts_by_priority": True,
                  "high_priority_reserve_blocks": min(reserve, w["num_blocks"] - 1)}
    check_load(w)


@pytest.mark.parametrize("seed", range(3))
def test_heavy_overload_preempts_a_lot_and_still_finishes_everything(seed: int) -> None:
    rng = random.Random(seed)
    w = {
        "num_blocks": 24,
        "block_size": 4,
        "max_batch_size": 16,
        "requests": [
            (rng.randint(0, 20), rng.randint(1, 30), rng.randint(20, 60), rng.randint(0, 1))
            for _ in range(60)
        ],
        "sampled_tokens": [5, 6],  # no EOS: every request runs to max_tokens
        "seed": seed,
        "abort_some": True,
        "reserve_some": True,
        "suspend_some": True,
    }
    sched = check_load(w)
    assert sched.num_preemptions >= 10


def check_load(w: dict) -> LocalScheduler:  # type: ignore[type-arg]
    """Run a workload to completion, checking the scheduler's promises after every step."""
    rng = random.Random(w["seed"])
    sampled_tokens = w.get("sampled_tokens", [5, 6, 8, 9, EOS])
    num_blocks, block_size = w["num_blocks"], w["block_size"]
    max_step_tokens = w.get("max_step_tokens")
    sched = make(
        num_blocks=num_blocks,
        block_size=block_size,
        max_batch_size=w["max_batch_size"],
        max_step_tokens=max_step_tokens,
        **w.get("rules", {}),
    )
    priority_preemption = w.get("rules", {}).get("priority_preemption", False)
    arrivals = sorted(w["requests"], key=lambda r: r[0])
    admitted: set[str] = set()
    finished: dict[str, int] = {}
    aborted: set[str] = set()
    next_index: dict[str, int] = {}
    reservations: list[int] = []
    step = 0
    arrivals_done_at = max(r[0] for r in arrivals)
    while step <= arrivals_done_at or sched.has_unfinished():
        assert step < 20_000, "requests did not finish after arrivals stopped"
        for i, (at, prompt_len, max_tokens, priority) in enumerate(arrivals):
            if at == step:
                rid = f"r{i}"
                try:
                    sched.add_request(rid, [1] * prompt_len, sp(max_tokens=max_tokens), priority)
                    admitted.add(rid)
                except RequestRejected as exc:
                    assert exc.reason is RejectReason.EXCEEDS_CAPACITY
                    assert prompt_len > num_blocks * block_size
        if step <= arrivals_done_at:
            if w["reserve_some"] and rng.random() < 0.2 and sched.blocks.num_free_blocks:
                num = rng.randint(1, sched.blocks.num_free_blocks)
                reservations.append(sched.reserve(num).reservation_id)
            if w["abort_some"] and rng.random() < 0.1 and sched.has_unfinished():
                victim = rng.choice(sorted(admitted - aborted - set(finished)))
                assert sched.abort(victim)
                aborted.add(victim)
            running_ids = [r.request_id for r in sched._running if r.status is RequestStatus.RUNNING]
            if w["suspend_some"] and running_ids and rng.random() < 0.2:
                sched.suspend(rng.choice(running_ids))
        else:  # arrivals have stopped: give back what the migrations held
            while reservations:
                sched.release_reservation(reservations.pop())
            for r in list(sched._running):
                if r.status is RequestStatus.SUSPENDED:
                    sched.resume(r.request_id)

        # What the step must do, computed from the state before it.
        running_before = [r for r in sched._running if r.status is RequestStatus.RUNNING]
        growth_needed = sum(
            max(0, sched.blocks.blocks_for_tokens(r.num_tokens) - len(r.block_ids)) for r in running_before
        )
        free_before = sched.blocks.num_free_blocks
        lowest_first = sorted(running_before, key=lambda r: (-r.priority, -r.arrival_seq))

        plan = sched.schedule()
        if plan.preempted and priority_preemption:
            victims = [sched.request(rid) for rid in plan.preempted if rid in sched]
            assert all(v.status is RequestStatus.PREEMPTED for v in victims)
        elif plan.preempted:
            assert growth_needed > free_before, "preempted although every running request could grow"
            expected = [r.request_id for r in lowest_first[: len(plan.preempted)]]
            assert plan.preempted == expected, "victims must be the newest of the lowest priority"
        else:
            assert growth_needed <= free_before
        scheduled = [p.request for p in plan.prefills] + plan.decodes
        assert len(scheduled) <= max(w["max_batch_size"], len(running_before))
        if max_step_tokens is not None:
            assert plan.num_prefill_tokens <= max(max_step_tokens - len(plan.decodes), block_size)
        chunks = {p.request.request_id for p in plan.prefills if not p.final}
        ids = [r.request_id for r in scheduled if r.request_id not in chunks]
        tokens = {rid: rng.choice(sampled_tokens) for rid in ids}
        outs = sched.update_from_output(plan, tokens)

        # Capacity and exact accounting after every step.
        held = [b for r in sched._requests.values() for b in r.block_ids]
        assert len(held) == len(set(held)), "a block belongs to two requests"
        assert len(held) == sched.blocks.num_allocated_blocks
        assert sched.blocks.num_allocated_blocks + sched.blocks.num_reserved_blocks <= num_blocks
        for r in sched._requests.values():
            if r.status.holds_blocks:
                assert len(r.block_ids) * block_size >= r.num_computed_tokens
        assert not chunks & {o.request_id for o in outs}, "a prompt chunk sampled a token"
        for o in outs:
            assert o.first_index == next_index.get(o.request_id, 0), "token indices must be contiguous"
            next_index[o.request_id] = o.first_index + 1
            if o.finished:
                assert o.request_id not in finished
                finished[o.request_id] = step
        step += 1

    assert set(finished) | aborted == admitted
    assert not set(finished) & aborted
    for reservation_id in reservations:
        sched.release_reservation(reservation_id)
    assert sched.blocks.num_free_blocks == num_blocks
    sched.blocks.check_invariants()
    return sched
