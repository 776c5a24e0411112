"""Dispatch that counts the running requests' expected decode growth, live, and its exact replay.

Two instances on a real nats-server report load: ``grower`` holds few blocks but its decoding
requests are expected to take most of its room soon (``LoadReport.expected_growth_blocks``);
``steady`` holds more and expects no growth. The round-3 rule (``blocks_ahead``) sees only the
blocks held now and sends new requests to ``grower``, where they would soon be preempted or
preempt; ``blocks_ahead_growth`` sends them to ``steady``. Either way every decision of the log
recomputes equal from the recorded reports (a log recorded under ``blocks_ahead`` keeps its rule).
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
    [(DispatchPolicy.BLOCKS_AHEAD_GROWTH, "steady"), (DispatchPolicy.BLOCKS_AHEAD, "grower")],
)
async def test_dispatch_avoids_an_instance_its_running_requests_will_fill_and_replays_exactly(
    nats_url: str, policy: DispatchPolicy, chosen: str
) -> None:
    prefix = new_prefix()
    try:
        replies, log = await place_under_policy(nats_url, prefix, lambda bus: [
            FakeAgent(bus, "grower", hog_blocks=100, growth_blocks=280, lifetime_reports=1),
            FakeAgent(bus, "steady", hog_blocks=200, lifetime_reports=1),
        ], policy)
        assert [reply.instance_id for reply in replies] == [chosen] * 4
        reports = assert_dispatches_replay_exactly(log, policy)
        assert {r.expected_growth_blocks for r in reports if r.instance_id == "grower"} == {280}
    finally:
        await delete_streams(nats_url, prefix)


async def test_a_stalled_queue_s_request_moves_where_it_stays_and_the_move_replays_exactly(
    nats_url: str,
) -> None:
    # ``src`` is full with one request queued; ``filling`` has the most room now but its decoding
    # requests are expected to take it; ``roomy`` has less room now and keeps enough after growth.
    # The round-3 move went to ``filling`` (where the request starts, then gets preempted).
    queued = QueuedRequest(request_id="waiting", num_prompt_tokens=64)
    prefix = new_prefix()
    try:
        moves, _ = await move_under_policy(nats_url, prefix, lambda bus: [
            FakeAgent(bus, "src", hog_blocks=390, queued=queued),
            FakeAgent(bus, "filling", hog_blocks=100, growth_blocks=320),
            FakeAgent(bus, "roomy", hog_blocks=200, growth_blocks=50),
        ], DispatchPolicy.BLOCKS_AHEAD)
        assert [(m.request_id, m.requeued_from, m.instance_id) for m in moves] == [
            ("waiting", "src", "roomy")
        ]
        assert moves[0].exclude == ("src", "filling")  # what growth ruled out, for `shoal replay --request`
    finally:
        await delete_streams(nats_url, prefix)
