"""Dispatch that counts the prompts admitted but not yet prefilled, live, and its exact replay.

Two instances on a real nats-server report load: ``prefilling`` holds few blocks but is computing
a long prompt admitted in the step in flight (``LoadReport.prefill_blocks``); ``decoding`` holds
more and prefills nothing. Nothing is queued on either, so ``blocks_ahead`` (the rule of rounds
2-5) sees a request start at once on both and sends it to ``prefilling``, the most room per
request, where it waits for the whole step in flight; ``prefill_ahead`` sends it to ``decoding``.
Either way every decision of the log recomputes equal from the recorded reports (a log recorded
under ``blocks_ahead`` keeps its rule, whatever ``prefill_blocks`` its reports carry). The move of
a stalled queue's request ranks the instances where it starts at once the same way.
"""

from __future__ import annotations

import pytest

from scheduler.config import DispatchPolicy
from schemas.load import QueuedRequest
from tests.scheduler.service_helpers import (
    FakeAgent,
    assert_dispatches_replay_exactly,
    delete_streams,
    move_under_policy,
    new_prefix,
    place_under_policy,
)


@pytest.mark.parametrize(
    ("policy", "chosen"),
    [(DispatchPolicy.PREFILL_AHEAD, "decoding"), (DispatchPolicy.BLOCKS_AHEAD, "prefilling")],
)
async def test_dispatch_avoids_an_instance_busy_prefilling_and_replays_exactly(
    nats_url: str, policy: DispatchPolicy, chosen: str
) -> None:
    prefix = new_prefix()
    try:
        replies, log = await place_under_policy(nats_url, prefix, lambda bus: [
            FakeAgent(bus, "prefilling", hog_blocks=100, prefill_blocks=90, lifetime_reports=1),
            FakeAgent(bus, "decoding", hog_blocks=200, lifetime_reports=1),
        ], policy)
        assert [reply.instance_id for reply in replies] == [chosen] * 4
        reports = assert_dispatches_replay_exactly(log, policy)
        assert {r.prefill_blocks for r in reports if r.instance_id == "prefilling"} == {90}
    finally:
        await delete_streams(nats_url, prefix)


@pytest.mark.parametrize(
    ("policy", "chosen"),
    [(DispatchPolicy.PREFILL_AHEAD, "decoding"), (DispatchPolicy.BLOCKS_AHEAD, "prefilling")],
)
async def test_a_stalled_queue_s_request_moves_where_no_prefill_is_in_flight_and_replays_exactly(
    nats_url: str, policy: DispatchPolicy, chosen: str
) -> None:
    # ``src`` is full with one request queued; the request would start at once on both others
    queued = QueuedRequest(request_id="waiting", num_prompt_tokens=64)
    prefix = new_prefix()
    try:
        moves, _ = await move_under_policy(nats_url, prefix, lambda bus: [
            FakeAgent(bus, "src", hog_blocks=390, queued=queued),
            FakeAgent(bus, "prefilling", hog_blocks=100, prefill_blocks=90),
            FakeAgent(bus, "decoding", hog_blocks=200),
        ], policy)
        assert [(m.request_id, m.requeued_from, m.instance_id, m.policy) for m in moves] == [
            ("waiting", "src", chosen, policy.value)
        ]
        assert moves[0].exclude == ("src",)  # both others start it at once
    finally:
        await delete_streams(nats_url, prefix)
