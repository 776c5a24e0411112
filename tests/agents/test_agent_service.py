"""The agent on a real nats-server with the sim engine: announce, RPCs, token deltas, load reports."""

from __future__ import annotations

import asyncio

from agents.engines.sim import sim_token_id
from schemas import (
    AbortReply,
    AbortRequest,
    CommandReply,
    FinishReason,
    GenerateRequest,
    InstanceJoined,
    InstanceLeft,
    LoadReport,
    RejectReason,
    ResendRequest,
    RpcError,
    RpcErrorCode,
    TokenDeltaBatch,
)
from tests.agents.agent_cluster import agent_cluster, fast_agent_config, greedy, sim_engine


async def test_announces_streams_tokens_and_reports_load(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        agent = await cluster.add(sim_engine(time_scale=10.0), fast_agent_config("a1"))
        joined = [env.body for _, env in await cluster.stored(cluster.subjects.instance("a1"))]
        assert isinstance(joined[0], InstanceJoined)
        assert joined[0].num_blocks == 64 and joined[0].block_size == 4
        assert joined[0].transport_address == agent.transport.address
        assert joined[0].model.model_id == "shoal/tiny-test"

        watcher = await cluster.watch("r1")
        request = GenerateRequest(request_id="r1", token_ids=(5, 6, 7), sampling=greedy(12, seed=3))
        reply = await cluster.generate("a1", request)
        assert reply.accepted and reply.num_accepted == 1
        again = await cluster.generate("a1", request)  # idempotent: no second copy
        assert again == reply
        await watcher.wait_finished()
        tokens = watcher.tokens()
        assert tokens == [sim_token_id("r1", 3, i, 1000, 0) for i in range(12)]
        assert watcher.deltas[-1].finish_reason is FinishReason.LENGTH
        assert all(d.owner_epoch == 0 and d.instance_id == "a1" for d in watcher.deltas)
        assert len(watcher.deltas) > 1  # one delta per step, not one in all
        await asyncio.sleep(0.2)
        assert agent.num_accepted == 1
        stored = await cluster.stored(cluster.subjects.load("a1"), cluster.subjects.loads_stream)
        reports = [env.body for _, env in stored]
        assert reports and all(isinstance(r, LoadReport) for r in reports)
        assert [r.seq for r in reports] == sorted(r.seq for r in reports)
        assert any(r.batch_size == 1 for r in reports)  # it saw the request running
        last = reports[-1]
        assert last.num_accepted == 1 and last.num_free_blocks == 64 and last.freeness == 64.0

        # resend re-publishes from an index
        num_before = len(watcher.deltas)
        resend = await cluster.call("a1", "resend", ResendRequest(request_id="r1", from_index=10))
        assert isinstance(resend, CommandReply) and resend.accepted
        await asyncio.sleep(0.1)
        resent = watcher.deltas[num_before:]
        assert resent and resent[-1].first_index + len(resent[-1].token_ids) == 12
        assert resent[0].first_index == 10 and resent[0].token_ids[0] == tokens[10]
        await watcher.close()

        await agent.stop()
        events = [env.body for _, env in await cluster.stored(cluster.subjects.instance("a1"))]
        assert isinstance(events[-1], InstanceLeft)


async def test_abort_and_rejection(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        await cluster.add(sim_engine(time_scale=5.0), fast_agent_config("a1"))
        watcher = await cluster.watch("long")
        reply = await cluster.generate(
            "a1", GenerateRequest(request_id="long", token_ids=(1, 2), sampling=greedy(200))
        )
        assert reply.accepted
        await asyncio.sleep(0.1)
        answer = await cluster.call("a1", "abort", AbortRequest(request_id="long"))
        assert answer == AbortReply(request_id="long", found=True)
        await watcher.wait_finished()
        assert watcher.deltas[-1].finish_reason is FinishReason.ABORT
        assert len(watcher.tokens()) < 200
        await watcher.close()
        quiet = await cluster.watch("quiet")
        request = GenerateRequest(request_id="quiet", token_ids=(9, 9), sampling=greedy(6), stream=False)
        assert (await cluster.generate("a1", request)).accepted
        await quiet.wait_finished()
        assert len(quiet.deltas) == 1 and quiet.tokens() == [
            sim_token_id("quiet", None, i, 1000, 0) for i in range(6)
        ]
        await quiet.close()
        missing = await cluster.call("a1", "abort", AbortRequest(request_id="nope"))
        assert missing == AbortReply(request_id="nope", found=False)
        # a generate the abort overtook (its frontend gave up on this agent) is refused, not run
        overtaken = GenerateRequest(request_id="nope", token_ids=(1, 2), sampling=greedy(4))
        late = await cluster.generate("a1", overtaken)
        assert not late.accepted and late.reason is RejectReason.ABORTED
        # an abort of a request that ran here and finished leaves nothing behind: a rescue of it
        # (the next owner epoch) still runs here
        assert (await cluster.call("a1", "abort", AbortRequest(request_id="quiet"))).found is False
        rescue = GenerateRequest(request_id="quiet", token_ids=(9, 9), sampling=greedy(6), owner_epoch=1)
        assert (await cluster.generate("a1", rescue)).accepted
        too_long = await cluster.generate(
            "a1", GenerateRequest(request_id="big", token_ids=tuple(range(1, 400)), sampling=greedy(4))
        )
        assert not too_long.accepted and too_long.reason is RejectReason.EXCEEDS_MODEL_CONTEXT
        assert "big" in too_long.detail  # the engine's sentence, for people


async def test_deltas_for_a_delta_subject_come_in_one_message_per_step(nats_url: str) -> None:
    """Requests naming a frontend's subject get one TokenDeltaBatch per step; others their own deltas."""
    async with agent_cluster(nats_url) as cluster:
        await cluster.add(sim_engine(time_scale=10.0), fast_agent_config("a1"))
        subject = cluster.subjects.tok_batch("f1")
        batches: list[TokenDeltaBatch] = []
        subscription = await cluster.bus.subscribe(subject)

        async def collect() -> None:
            async for message in subscription:
                body = cluster.codec.decode(message.data).body
                assert isinstance(body, TokenDeltaBatch), body
                batches.append(body)

        collector = asyncio.get_running_loop().create_task(collect())
        solo = await cluster.watch("solo")
        own_subjects = [await cluster.watch(f"b{i}") for i in range(3)]
        for request_id in ("b0", "b1", "b2"):
            request = GenerateRequest(
                request_id=request_id, token_ids=(5, 6), sampling=greedy(8, seed=1), delta_subject=subject
            )
            assert (await cluster.generate("a1", request)).accepted
        request = GenerateRequest(request_id="solo", token_ids=(5, 6), sampling=greedy(8, seed=1))
        assert (await cluster.generate("a1", request)).accepted
        await solo.wait_finished()
        await asyncio.sleep(0.2)
        by_request: dict[str, list[int]] = {}
        for batch in batches:
            assert batch.instance_id == "a1"
            assert len({d.request_id for d in batch.deltas}) == len(batch.deltas)  # one delta per request
            for delta in batch.deltas:
                assert delta.first_index == len(by_request.setdefault(delta.request_id, []))
                by_request[delta.request_id].extend(delta.token_ids)
        expected = [sim_token_id("b0", 1, i, 1000, 0) for i in range(8)]
        assert by_request["b0"] == expected and sorted(by_request) == ["b0", "b1", "b2"]
        assert len(batches) < 3 * 8  # the three share messages (8 steps each if alone)
        assert solo.tokens() == [sim_token_id("solo", 1, i, 1000, 0) for i in range(8)]
        assert all(not watcher.deltas for watcher in own_subjects)  # nothing on their own subjects

        # a resend goes where the deltas went
        count = len(batches)
        resend = await cluster.call("a1", "resend", ResendRequest(request_id="b1", from_index=6))
        assert isinstance(resend, CommandReply) and resend.accepted
        await asyncio.sleep(0.2)
        assert [d.first_index for b in batches[count:] for d in b.deltas] == [6, 7]

        bad = GenerateRequest(request_id="x", token_ids=(1,), sampling=greedy(2), delta_subject="a.*")
        reply = await cluster.call("a1", "generate", bad)
        assert isinstance(reply, RpcError) and reply.code is RpcErrorCode.BAD_REQUEST
        dotted = GenerateRequest(request_id="x.y", token_ids=(1,), sampling=greedy(2))  # no subject for it
        reply = await cluster.call("a1", "generate", dotted)
        assert isinstance(reply, RpcError) and reply.code is RpcErrorCode.BAD_REQUEST
        assert (await cluster.generate("a1", GenerateRequest(request_id="after", token_ids=(1,),
                                                             sampling=greedy(2)))).accepted
        await subscription.unsubscribe()
        collector.cancel()
        for watcher in (solo, *own_subjects):
            await watcher.close()


async def test_while_requests_decode_reports_come_less_often_but_new_work_is_reported_at_once(
    nats_url: str,
) -> None:
    """Blocks filling under decoding requests are reported every gradual interval, not every report
    interval; an accepted request (what the scheduler dispatches on) goes out within one interval."""
    config = fast_agent_config(
        "a1", report_interval_s=0.02, heartbeat_interval_s=5.0, gradual_report_interval_s=0.6
    )
    async with agent_cluster(nats_url) as cluster:
        agent = await cluster.add(sim_engine(num_blocks=512, time_scale=4.0), config)  # ~200 steps in 2 s
        for index in range(4):
            request = GenerateRequest(request_id=f"r{index}", token_ids=(5, 6), sampling=greedy(100_000))
            assert (await cluster.generate("a1", request)).accepted
        await asyncio.sleep(0.3)
        free_before, reports_before = agent.engine.stats().num_free_blocks, agent.num_reports
        await asyncio.sleep(1.5)
        assert agent.engine.stats().num_free_blocks < free_before - 4  # blocks kept filling
        sent = agent.num_reports - reports_before
        assert 1 <= sent <= 4  # 1.5 s / 0.6 s, not 1.5 s / 0.02 s

        request = GenerateRequest(request_id="new", token_ids=(5, 6), sampling=greedy(100_000))
        reports_before = agent.num_reports
        assert (await cluster.generate("a1", request)).accepted
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 0.4  # well inside the gradual interval
        while True:  # a report built just before the accept may still be on its way: the next one
            if agent.num_reports != reports_before:
                reports_before = agent.num_reports
                stored = await cluster.stored(cluster.subjects.load("a1"), cluster.subjects.loads_stream)
                if stored[-1][1].body.num_accepted == 5:
                    break
            assert loop.time() < deadline, "the accepted request was not reported promptly"
            await asyncio.sleep(0.01)


async def test_an_agent_killed_as_work_arrives_stops(nats_url: str) -> None:
    """A kill that lands in the same loop turn as new work (a generate, a migration's wake) ends the agent.

    The idle step loop waits on its work event with a timeout; Python 3.11's ``asyncio.wait_for``
    dropped a cancellation that arrived together with the event, so the loop ran on and the kill
    waited for it forever (seen as a hung scheduler test that kills agents under load)."""
    async with agent_cluster(nats_url) as cluster:
        for k in range(5):
            agent = await cluster.add(sim_engine(time_scale=10.0), fast_agent_config(f"k{k}"))
            await asyncio.sleep(0.05)  # the step loop is idle, waiting for work
            agent.wake()
            async with asyncio.timeout(5):
                await agent.kill()
