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

import asyncio

import pytest

from scheduler.config import DispatchPolicy, PolicyConfig
from scheduler.logfile import read_bus_log
from scheduler.replay import replay_log
from scheduler.service import SchedulerConfig, SchedulerService
from schemas import Codec, LoadReport
from schemas.decisions import Dispatched
from schemas.load import QueuedRequest
from tests.scheduler.service_helpers import FakeAgent, connected, delete_streams, new_prefix, place


@pytest.mark.parametrize(
    ("policy", "chosen"),
    [(DispatchPolicy.PREFILL_AHEAD, "decoding"), (DispatchPolicy.BLOCKS_AHEAD, "prefilling")],
)
async def test_dispatch_avoids_an_instance_busy_prefilling_and_replays_exactly(
    nats_url: str, policy: DispatchPolicy, chosen: str
) -> None:
    prefix = new_prefix()
    try:
        async with connected(nats_url, prefix) as agent_bus, connected(nats_url, prefix) as sched_bus:
            agents = [
                FakeAgent(agent_bus, "prefilling", hog_blocks=100, prefill_blocks=90, lifetime_reports=1),
                FakeAgent(agent_bus, "decoding", hog_blocks=200, lifetime_reports=1),
            ]
            for agent in agents:
                await agent.start()
            config = SchedulerConfig(
                policy=PolicyConfig(dispatch_policy=policy), lease_ttl_s=1.0, pairing_interval_s=0.1
            )
            service = SchedulerService(sched_bus, config)
            task = asyncio.create_task(service.run())
            try:
                await service.wait_active(10)
                await asyncio.sleep(0.2)  # both instances reported
                replies = []
                for k in range(4):
                    replies.append(await place(agent_bus, f"r{k}"))
                    await asyncio.sleep(0.12)  # the previous request's report lands and expires
            finally:
                await service.stop()
                await asyncio.wait_for(task, 10)
            for agent in agents:
                await agent.stop()
            log = await read_bus_log(agent_bus)

        assert [reply.instance_id for reply in replies] == [chosen] * 4
        codec = Codec()
        dispatched = [b for e in log.events if isinstance(b := codec.decode(e.data).body, Dispatched)]
        assert [d.policy for d in dispatched] == [policy.value] * 4
        reports = [b for e in log.loads if isinstance(b := codec.decode(e.data).body, LoadReport)]
        assert {r.prefill_blocks for r in reports if r.instance_id == "prefilling"} == {90}
        result = replay_log(log)
        assert result.mismatches == [] and result.num_unverifiable == 0
        recomputed = [row for row in result.decisions if isinstance(row.decision, Dispatched)]
        assert len(recomputed) == 4 and all(row.matches for row in recomputed)
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
        async with connected(nats_url, prefix) as agent_bus, connected(nats_url, prefix) as sched_bus:
            agents = [
                FakeAgent(agent_bus, "src", hog_blocks=390, queued=queued),
                FakeAgent(agent_bus, "prefilling", hog_blocks=100, prefill_blocks=90),
                FakeAgent(agent_bus, "decoding", hog_blocks=200),
            ]
            for agent in agents:
                await agent.start()
            config = SchedulerConfig(
                policy=PolicyConfig(dispatch_policy=policy),
                lease_ttl_s=1.0, pairing_interval_s=0.05, requeue_after_s=0.3,
            )
            service = SchedulerService(sched_bus, config)
            task = asyncio.create_task(service.run())
            try:
                await service.wait_active(10)
                async with asyncio.timeout(10):
                    while service.stats.requeues == 0:
                        await asyncio.sleep(0.05)
                await asyncio.sleep(0.2)  # more ticks: the request does not move twice
            finally:
                await service.stop()
                await asyncio.wait_for(task, 10)
            for agent in agents:
                await agent.stop()
            log = await read_bus_log(agent_bus)

        codec = Codec()
        moves = [
            b for e in log.events
            if isinstance(b := codec.decode(e.data).body, Dispatched) and b.requeued_from
        ]
        assert [(m.request_id, m.requeued_from, m.instance_id, m.policy) for m in moves] == [
            ("waiting", "src", chosen, policy.value)
        ]
        assert moves[0].exclude == ("src",)  # both others start it at once
        result = replay_log(log)
        assert result.mismatches == [] and result.num_unverifiable == 0
        replayed = [row for row in result.decisions if row.kind == "requeue"]
        assert len(replayed) == 1 and replayed[0].matches
    finally:
        await delete_streams(nats_url, prefix)
