"""Pure parts of the agent: load reports from engine stats, the delta buffer behind ``resend``."""

from __future__ import annotations

from agents.deltas import DeltaBuffer
from agents.engines.sim import SimEngine
from agents.reporting import build_load_report, load_signature, urgent_signature
from scheduler.config import PolicyConfig
from scheduler.policy import InstanceLoad, load_freeness
from schemas import InstanceJoined, LoadReport, SamplingParams, TokenDelta


def test_agent_and_scheduler_agree_on_freeness() -> None:
    engine = SimEngine("tiny-test", num_blocks=64)
    engine.add_request("hi", list(range(1, 30)), SamplingParams(max_tokens=50), priority=-1)
    engine.add_request("lo", list(range(1, 10)), SamplingParams(max_tokens=50), priority=2)
    engine.add_request("queued", list(range(1, 241)), SamplingParams(max_tokens=5), priority=2)
    for _ in range(3):
        engine.step()
    engine.reserve(5)
    config = PolicyConfig()
    report = build_load_report(
        engine.stats(), instance_id="a", seq=1, block_size=4, num_accepted=3, config=config
    )
    assert report.batch_size == 2 and report.num_reserved_blocks == 5 and report.num_waiting == 1
    assert report.head_of_line_demand == engine.stats().head_of_line_demand >= 60
    assert report.waiting_demand == 60
    info = engine.info
    joined = InstanceJoined(
        instance_id="a",
        num_blocks=64,
        block_size=4,
        model=info.model,
        kv_layout=info.kv_layout,
        transport_address="tcp://x:1",
    )
    assert load_freeness(InstanceLoad.from_report(report, joined), config) == report.freeness
    terminating = build_load_report(
        engine.stats(), instance_id="a", seq=2, block_size=4, num_accepted=3, config=config, terminating=True
    )
    assert terminating.freeness == float("-inf")
    assert load_signature(report) != load_signature(terminating)


def _delta(first: int, tokens: tuple[int, ...], finish: str | None = None) -> TokenDelta:
    return TokenDelta(
        request_id="r",
        instance_id="a",
        owner_epoch=0,
        first_index=first,
        token_ids=tokens,
        finish_reason=finish,
    )


def test_resend_trims_to_the_asked_index_and_survives_the_finish() -> None:
    buffer = DeltaBuffer(steps_per_request=3, finished_limit=1)
    buffer.open("r", owner_epoch=0, stream=True, prompt_token_ids=(1,), sampling=SamplingParams(), priority=0)
    for delta in (_delta(0, (10,)), _delta(1, (11, 12)), _delta(3, (13,)), _delta(4, (14,), "length")):
        buffer.record(delta)
    assert buffer.resend("r", 2) == [_delta(2, (12,)), _delta(3, (13,)), _delta(4, (14,), "length")]
    assert buffer.resend("r", 5) == [_delta(5, (), "length")]  # only the finish is left to say
    assert buffer.resend("r", 0) == [_delta(1, (11, 12)), _delta(3, (13,)), _delta(4, (14,), "length")]
    buffer.close("r")
    assert buffer.live("r") is None and buffer.resend("r", 4) == [_delta(4, (14,), "length")]
    buffer.open("s", owner_epoch=0, stream=True, prompt_token_ids=(1,), sampling=SamplingParams(), priority=0)
    buffer.close("s")  # only one finished request is kept
    assert buffer.resend("r", 0) is None and buffer.resend("unknown", 0) is None


def test_blocks_filling_under_decodes_are_not_urgent_but_new_work_is() -> None:
    engine = SimEngine("tiny-test", num_blocks=64)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    config = PolicyConfig()

    def report(num_accepted: int = 1) -> LoadReport:
        return build_load_report(
            engine.stats(), instance_id="a", seq=1, block_size=4, num_accepted=num_accepted, config=config
        )

    engine.step()
    first = report()
    for _ in range(4):  # four more tokens: the request fills another block of 4
        engine.step()
    grown = report()
    assert grown.num_free_blocks < first.num_free_blocks
    assert load_signature(grown) != load_signature(first)
    assert urgent_signature(grown) == urgent_signature(first)
    assert urgent_signature(report(num_accepted=2)) != urgent_signature(grown)  # a request was accepted
    engine.add_request("b", [1, 2], SamplingParams(max_tokens=5))
    assert urgent_signature(report()) != urgent_signature(grown)  # one more waiting


def test_the_request_a_stalled_queue_may_lose_is_its_newest_that_never_ran() -> None:
    from agents.reporting import requeue_candidate

    engine = SimEngine("tiny-test", num_blocks=64, max_batch_size=1)
    engine.add_request("running", list(range(1, 9)), SamplingParams(max_tokens=50))
    engine.step()
    assert requeue_candidate(engine.stats(), lambda r: True) is None  # nothing queued
    engine.add_request("head", list(range(1, 9)), SamplingParams(max_tokens=5))
    candidate = requeue_candidate(engine.stats(), lambda r: True)
    assert candidate is not None and candidate.request_id == "head"  # the head, when it is alone
    engine.add_request("second", list(range(1, 13)), SamplingParams(max_tokens=5), priority=1)
    engine.add_request("newest", list(range(1, 5)), SamplingParams(max_tokens=5))
    # admission order: head, newest (priority 0), second (priority 1): the last one goes first
    candidate = requeue_candidate(engine.stats(), lambda r: True)
    assert candidate is not None and (candidate.request_id, candidate.num_prompt_tokens) == ("second", 12)
    assert candidate.priority == 1
    moved_before = {"second"}
    candidate = requeue_candidate(engine.stats(), lambda r: r.request_id not in moved_before)
    assert candidate is not None and candidate.request_id == "newest"
    engine.add_request("resumed", list(range(1, 9)), SamplingParams(max_tokens=9), output_token_ids=(5, 6))
    candidate = requeue_candidate(engine.stats(), lambda r: r.request_id not in moved_before)
    assert candidate is not None and candidate.request_id == "newest"  # a rescued one has tokens: it stays
    report = build_load_report(
        engine.stats(),
        instance_id="a",
        seq=1,
        block_size=4,
        num_accepted=5,
        config=PolicyConfig(),
        head_of_line_wait_s=2.5,
        requeue_candidate=candidate,
    )
    assert report.head_of_line_wait_s == 2.5 and report.requeue_candidate == candidate


def test_the_report_counts_the_growth_expected_of_decoding_requests() -> None:
    # block size 4: a request of 8 prompt tokens that decoded 2 holds 3 blocks; with 40 output tokens
    # expected it needs 38 more tokens: ceil(48 / 4) - 3 = 9 blocks (the same function the simulator's
    # instances call, so live and simulated reports agree)
    engine = SimEngine("tiny-test", num_blocks=64)
    engine.add_request("r", list(range(1, 9)), SamplingParams(max_tokens=500), priority=0)
    for _ in range(2):
        engine.step()
    stats = engine.stats()
    [request] = stats.requests
    assert (request.num_tokens, request.num_blocks) == (10, 3)
    config = PolicyConfig()
    unknown = build_load_report(stats, instance_id="a", seq=1, block_size=4, num_accepted=1, config=config)
    assert unknown.expected_growth_blocks == 0  # nothing finished here yet: no estimate
    report = build_load_report(
        stats, instance_id="a", seq=1, block_size=4, num_accepted=1, config=config, expected_output_tokens=40
    )
    assert report.expected_growth_blocks == 9
    assert InstanceLoad.from_report(report).expected_growth_blocks == 9
    past = build_load_report(
        stats, instance_id="a", seq=1, block_size=4, num_accepted=1, config=config, expected_output_tokens=2
    )
    assert past.expected_growth_blocks == 0


def test_the_report_counts_the_prompts_admitted_but_not_yet_prefilled() -> None:
    # block size 4: a 30-token prompt admitted in the step in flight holds 8 blocks and has all 30
    # tokens still to compute (8 blocks of prefill ahead of anything placed here); once the step ends
    # it decodes and nothing is left to prefill. The simulator's instances count it the same way.
    engine = SimEngine("tiny-test", num_blocks=64)
    engine.add_request("r", list(range(1, 31)), SamplingParams(max_tokens=500), priority=0)
    config = PolicyConfig()
    plan, duration = engine.begin_step()
    during = build_load_report(
        engine.stats(), instance_id="a", seq=1, block_size=4, num_accepted=1, config=config
    )
    assert during.prefill_blocks == 8 and during.num_waiting == 0
    assert InstanceLoad.from_report(during).prefill_blocks == 8
    engine.end_step(plan, duration)
    after = build_load_report(
        engine.stats(), instance_id="a", seq=2, block_size=4, num_accepted=1, config=config
    )
    assert after.prefill_blocks == 0
    # the step's end changes no count of requests, yet the scheduler must hear of it at once
    assert urgent_signature(after) != urgent_signature(during)


def test_the_report_says_how_much_of_the_queue_the_prefix_cache_holds() -> None:
    engine = SimEngine("tiny-test", num_blocks=64, prefix_cache=True)
    prompt = list(range(1, 42))  # 10 full blocks of 4 and one token
    engine.add_request("first", prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    engine.add_request("again", prompt, SamplingParams(max_tokens=1))  # queued until the next step
    config = PolicyConfig()
    report = build_load_report(
        engine.stats(), instance_id="a", seq=1, block_size=4, num_accepted=2, config=config
    )
    # 11 blocks of demand, 10 of them cached: one block's prefill is what the queue brings
    assert (report.waiting_demand, report.waiting_uncached_blocks) == (11, 1)
    assert InstanceLoad.from_report(report).queued_uncached_blocks == 1
    told = build_load_report(
        engine.stats(), instance_id="a", seq=2, block_size=4, num_accepted=2, config=config,
        waiting_cached_blocks=0,
    )
    assert told.waiting_uncached_blocks == 11
