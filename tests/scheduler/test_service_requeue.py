"""The scheduler moves a queued request off a stalled instance, live, and a replay recomputes it.

Two torch-engine agents on a real nats-server; one runs a request at a time and
is busy, so a second request queues behind it. With ``requeue_after_s`` the
scheduler sees the head of line wait in the load reports, decides with
:func:`~scheduler.recompute.requeue_decision` (the simulator's
``requeue_choice``), logs a ``Dispatched`` with ``requeued_from`` and sends the
source ``MoveQueued``; the agents move the request without KV. The client sees
exactly the greedy tokens of an unmoved run, from the new owner only, finished
once; every decision of the log, the move included, recomputes equal.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from agents.agent import Agent, FaultPlan, StepPace
from agents.engines.torch_engine import TorchEngine
from bus import JetStreamBus
from scheduler.config import DispatchPolicy, PolicyConfig
from scheduler.logfile import read_bus_log
from scheduler.replay import replay_log
from scheduler.service import SchedulerConfig, SchedulerService
from scheduler.timeline import request_timeline
from schemas import AbortRequest, Codec, Dispatched, GenerateRequest, MigrationCause, MigrationStarted
from tests.agents.agent_cluster import TokenWatcher, greedy, unmigrated_tokens
from tests.scheduler.service_helpers import bus_config, delete_streams, live_agent_config, new_prefix

PROMPT = tuple((i * 41) % 300 + 1 for i in range(40))
SAMPLING = greedy(24)
POLICY = PolicyConfig(dispatch_policy=DispatchPolicy.BLOCKS_AHEAD)


def _engine(max_batch_size: int = 256) -> TorchEngine:
    return TorchEngine("tiny", num_blocks=48, batch_invariant=True, max_batch_size=max_batch_size)


@contextlib.asynccontextmanager
async def _agent(
    url: str, prefix: str, instance_id: str, engine: TorchEngine, faults: FaultPlan | None = None
) -> AsyncIterator[Agent]:
    bus = JetStreamBus(bus_config(url, prefix))
    await bus.connect()
    config = replace(live_agent_config(), instance_id=instance_id, faults=faults or FaultPlan())
    agent = Agent(engine, bus, config)
    await agent.start()
    try:
        yield agent
    finally:
        await agent.stop()
        await bus.close()


def test_requeue_needs_the_blocks_ahead_policy() -> None:
    with pytest.raises(ValueError, match="blocks_ahead"):
        SchedulerConfig(requeue_after_s=1.0)  # the freeness policy
    with pytest.raises(ValueError, match="> 0"):
        SchedulerConfig(policy=POLICY, requeue_after_s=0.0)


async def test_a_stalled_queue_loses_its_request_live_and_the_replay_recomputes_the_move(
    nats_url: str,
) -> None:
    expected = unmigrated_tokens(_engine(), PROMPT, SAMPLING, "moving")
    prefix = new_prefix()
    codec = Codec(producer="test-client")
    try:
        async with (
            JetStreamBus(bus_config(nats_url, prefix)) as client,
            JetStreamBus(bus_config(nats_url, prefix)) as sched_bus,
            # the blocker, paced, lasts >= 5 s: the queue behind it stalls however fast the engine is
            _agent(nats_url, prefix, "q1", _engine(max_batch_size=1), FaultPlan(pace=StepPace(0.01))) as q1,
            _agent(nats_url, prefix, "q2", _engine()) as q2,
        ):
            config = SchedulerConfig(
                policy=POLICY, pairing_interval_s=0.05, requeue_after_s=0.3, lease_ttl_s=2.0
            )
            service = SchedulerService(sched_bus, config)
            task = asyncio.create_task(service.run())
            await service.wait_active(10)
            subjects = client.config.subjects
            watcher = TokenWatcher(await client.subscribe(subjects.tok("moving")), codec)
            for request in (
                GenerateRequest(request_id="blocker", token_ids=(3, 4, 5), sampling=greedy(100_000)),
                GenerateRequest(request_id="moving", token_ids=PROMPT, sampling=SAMPLING),
            ):
                await client.request(
                    subjects.rpc_agent("q1", "generate"), codec.encode(request, time=0.0), timeout=5.0
                )
            await watcher.wait_finished(timeout=20)
            await asyncio.sleep(0.3)  # ticks after the move: the request must not move twice
            assert watcher.tokens() == expected
            assert sum(1 for d in watcher.deltas if d.finish_reason is not None) == 1
            assert {(d.instance_id, d.owner_epoch) for d in watcher.deltas} == {("q2", 1)}
            assert service.stats.requeues == 1
            assert b'shoal_scheduler_decisions_total{kind="requeued"} 1.0' in service.metrics.render()
            # the running request is not the one moved (it may have hit the model's length by now, or
            # been migrated with its KV by pairing): abort it wherever it still runs
            for agent in (q1, q2):
                if agent.engine.request_stats("blocker") is not None:
                    await client.request(
                        subjects.rpc_agent(agent.instance_id, "abort"),
                        codec.encode(AbortRequest(request_id="blocker"), time=0.0),
                        timeout=5.0,
                    )
            await watcher.close()
            async with asyncio.timeout(10):
                while q1.engine.has_unfinished() or q2.engine.has_unfinished():
                    await asyncio.sleep(0.01)
            await service.stop()
            await asyncio.wait_for(task, 20)
            log = await read_bus_log(client)

        result = replay_log(log)
        moves = [row for row in result.decisions if row.kind == "requeue"]
        assert len(moves) == 1 and moves[0].matches and moves[0].verifiable
        move = moves[0].decision
        assert isinstance(move, Dispatched)
        assert (move.request_id, move.requeued_from, move.instance_id) == ("moving", "q1", "q2")
        assert result.mismatches == [] and result.num_unverifiable == 0
        started = [
            body
            for e in log.events
            if isinstance(body := codec.decode(e.data).body, MigrationStarted) and body.request_id == "moving"
        ]
        assert [s.cause for s in started] == [MigrationCause.REQUEUE]
        bodies = [codec.decode(e.data).body for e in log.events]
        assert not [
            b
            for b in bodies
            if isinstance(b, MigrationStarted)
            and b.request_id == "blocker"
            and b.cause is MigrationCause.REQUEUE
        ]
        timeline = request_timeline(log, "moving")  # shoal replay --request: the move, and why
        moved = [step for step in timeline.steps if step.kind == "requeued"]
        assert [(step.instance_id, step.detail["requeued_from"]) for step in moved] == [("q2", "q1")]
        outcomes = [s for s in result.migrations if s.request_id == "moving"]
        assert [s.outcome for s in outcomes] == ["committed"], outcomes
    finally:
        await delete_streams(nats_url, prefix)
