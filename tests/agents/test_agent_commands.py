"""Scheduler commands on a real nats-server: migrate out to a freeness target, stop, drain, stale epochs."""

from __future__ import annotations

import asyncio

from agents.engines.sim import SimEngine, sim_token_id
from schemas import (
    CommandRejectReason,
    CommandReply,
    Drain,
    GenerateRequest,
    InstanceLeft,
    InstanceTerminating,
    Liveness,
    LoadReport,
    MigrateOut,
    MigrationAbortReason,
    RejectReason,
    StopMigration,
)
from tests.agents.agent_cluster import AgentCluster, agent_cluster, fast_agent_config, greedy, sim_engine

PROMPT = tuple(range(1, 41))


async def _run(
    cluster: AgentCluster, instance: str, request_id: str, priority: int = 0, max_tokens: int = 150
) -> None:
    request = GenerateRequest(
        request_id=request_id, token_ids=PROMPT, sampling=greedy(max_tokens), priority=priority
    )
    assert (await cluster.generate(instance, request)).accepted


async def test_migrate_out_moves_lowest_priority_until_the_target(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(sim_engine(time_scale=4.0), fast_agent_config("a1"))
        a2 = await cluster.add(sim_engine(time_scale=4.0), fast_agent_config("a2"))
        await _run(cluster, "a1", "urgent", priority=0)
        await _run(cluster, "a1", "normal", priority=1)
        await _run(cluster, "a1", "lowest", priority=3)
        await asyncio.sleep(0.05)
        assert a1.load_report().freeness < 15
        reply = await cluster.call(
            "a1", "migrate_out", MigrateOut(epoch=1, destination_id="a2", target_freeness=15.0)
        )
        assert reply == CommandReply(accepted=True, detail="migrating")
        async with asyncio.timeout(5):
            while a1.migration.command is not None or not a1.migration.is_idle:
                await asyncio.sleep(0.01)
        on_a2 = {r.request_id for r in a2.engine.stats().requests}
        on_a1 = {r.request_id for r in a1.engine.stats().requests}
        assert on_a2 == {"lowest"} and on_a1 == {"urgent", "normal"}
        stale = await cluster.call("a1", "stop_migration", StopMigration(epoch=0, destination_id="a2"))
        assert stale == CommandReply(accepted=False, reason=CommandRejectReason.STALE_EPOCH)
        stopped = await cluster.call("a1", "stop_migration", StopMigration(epoch=1, destination_id="a2"))
        assert stopped.accepted


async def test_a_full_destination_ends_the_command_until_the_next_pairing(nats_url: str) -> None:
    """Out of blocks there aborts the migration with ``OUT_OF_BLOCKS``, and the source drops the
    ``MigrateOut`` command at once instead of trying its other requests on the full destination."""
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(sim_engine(time_scale=4.0), fast_agent_config("a1"))
        a2 = await cluster.add(sim_engine(num_blocks=6, time_scale=4.0), fast_agent_config("a2"))
        for priority, request_id in enumerate(("r1", "r2", "r3")):  # 10 full blocks each, a2 has 6
            await _run(cluster, "a1", request_id, priority=priority)
        await asyncio.sleep(0.05)
        reply = await cluster.call(
            "a1", "migrate_out", MigrateOut(epoch=1, destination_id="a2", target_freeness=99.0)
        )
        assert reply == CommandReply(accepted=True, detail="migrating")
        async with asyncio.timeout(5):
            while a1.migration.command is not None or not a1.migration.is_idle:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # ten ticks: a command still in force would start the next request
        outcomes = a1.migration.outcomes
        assert [(o.request_id, o.migrated, o.reason) for o in outcomes] == [
            ("r3", False, MigrationAbortReason.OUT_OF_BLOCKS)
        ]
        assert "destination aborted" in outcomes[0].detail
        assert a2.engine.stats().num_free_blocks == 6 and not a2.engine.has_unfinished()
        assert {r.request_id for r in a1.engine.stats().requests} == {"r1", "r2", "r3"}


async def test_a_command_with_room_sends_only_what_fits_and_keeps_requests_that_moved_enough(
    nats_url: str,
) -> None:
    """shoal's pairing: the command carries the destination's room; the source skips requests
    that would not fit (no ``OUT_OF_BLOCKS`` round trip) and sends one that does."""
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(sim_engine(time_scale=4.0), fast_agent_config("a1"))
        a2 = await cluster.add(sim_engine(num_blocks=12, time_scale=4.0), fast_agent_config("a2"))
        small = GenerateRequest(request_id="small", token_ids=PROMPT[:12], sampling=greedy(240), priority=0)
        assert (await cluster.generate("a1", small)).accepted
        for priority, request_id in ((1, "r1"), (2, "r2")):  # 10 full blocks each, lower priority
            await _run(cluster, "a1", request_id, priority=priority)
        await asyncio.sleep(0.05)
        command = MigrateOut(epoch=1, destination_id="a2", target_freeness=99.0, room_blocks=9)
        assert (await cluster.call("a1", "migrate_out", command)).accepted
        async with asyncio.timeout(5):
            while a1.migration.command is not None or not a1.migration.is_idle:
                await asyncio.sleep(0.01)
        assert [(o.request_id, o.migrated) for o in a1.migration.outcomes] == [("small", True)]
        assert {r.request_id for r in a2.engine.stats().requests} == {"small"}
        # a request that moved once stays when the command allows one move per request
        back = MigrateOut(epoch=2, destination_id="a1", target_freeness=99.0, max_moves_per_request=1)
        assert "small" in {r.request_id for r in a2.engine.stats().requests}  # still there to move
        assert (await cluster.call("a2", "migrate_out", back)).accepted
        await asyncio.sleep(0.2)
        assert a2.migration.outcomes == [] and a2.migration.command is None  # not even tried
        assert "small" not in {r.request_id for r in a1.engine.stats().requests}


async def test_migration_needs_matching_model_and_kv_layout(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(sim_engine(time_scale=4.0), fast_agent_config("a1"))
        await cluster.add(SimEngine("llama-7b-a10", num_blocks=64), fast_agent_config("big"))
        await _run(cluster, "a1", "r1")
        reply = await cluster.call(
            "a1", "migrate_out", MigrateOut(epoch=1, destination_id="big", target_freeness=99)
        )
        assert not reply.accepted and reply.reason is CommandRejectReason.INCOMPATIBLE
        outcome = await a1.migrate("r1", "big")
        assert not outcome.migrated and outcome.reason is MigrationAbortReason.INCOMPATIBLE
        unknown = await a1.migrate("r1", "nobody")
        assert not unknown.migrated and unknown.reason is MigrationAbortReason.UNKNOWN_DESTINATION


async def test_drain_migrates_everything_away_then_leaves(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(sim_engine(time_scale=4.0), fast_agent_config("a1"))
        a2 = await cluster.add(sim_engine(time_scale=4.0), fast_agent_config("a2"))
        watchers = {rid: await cluster.watch(rid) for rid in ("r1", "r2")}
        await _run(cluster, "a1", "r1", max_tokens=200)
        await _run(cluster, "a1", "r2", max_tokens=200)
        reply = await cluster.call("a1", "drain", Drain(epoch=2))
        assert reply.accepted
        refused = await cluster.generate(
            "a1", GenerateRequest(request_id="late", token_ids=(1, 2), sampling=greedy(4))
        )
        assert not refused.accepted and refused.reason is RejectReason.TERMINATING
        await asyncio.sleep(0.15)
        reports = [
            env.body
            for _, env in await cluster.stored(cluster.subjects.load("a1"), cluster.subjects.loads_stream)
        ]
        assert isinstance(reports[-1], LoadReport) and reports[-1].terminating
        assert reports[-1].freeness == float("-inf")
        move = await cluster.call(
            "a1", "migrate_out", MigrateOut(epoch=2, destination_id="a2", target_freeness=10.0)
        )
        assert move.accepted
        await asyncio.wait_for(a1.stopped.wait(), 10)
        events = [env.body for _, env in await cluster.stored(cluster.subjects.instance("a1"))]
        assert any(isinstance(e, InstanceTerminating) for e in events) and isinstance(
            events[-1], InstanceLeft
        )
        for rid, watcher in watchers.items():
            await watcher.wait_finished()
            assert watcher.tokens() == [sim_token_id(rid, None, i, 1000, 0) for i in range(200)]
            assert {d.owner_epoch for d in watcher.deltas} == {0, 1}
            assert watcher.deltas[-1].instance_id == "a2", rid
            await watcher.close()
        assert not a2.engine.has_unfinished()


async def test_liveness_says_whether_reports_are_still_being_sent(nats_url: str) -> None:
    """The scheduler's probe of a silent instance: an agent whose appends fail (its loads stream is
    gone) still says it is reporting, with the error; one whose report loop stopped says it is not."""
    async with agent_cluster(nats_url) as cluster:
        agent = await cluster.add(sim_engine(), fast_agent_config("a1"))
        await asyncio.sleep(0.3)
        answer = await cluster.call("a1", "liveness", Drain(epoch=0))
        assert isinstance(answer, Liveness) and answer.reporting and answer.last_error == ""
        assert answer.seconds_since_stored is not None and answer.seconds_since_stored < 1.0
        await cluster.bus.client.jsm().delete_stream(cluster.subjects.loads_stream)
        async with asyncio.timeout(10):
            while not (answer := await cluster.call("a1", "liveness", Drain(epoch=0))).last_error:
                await asyncio.sleep(0.1)
        assert answer.reporting  # still trying: the reports stop on the bus, not in the agent
        assert agent._report_task is not None
        agent._report_task.cancel()  # the loop dies, the RPCs still answer
        await asyncio.sleep(0.05)
        answer = await cluster.call("a1", "liveness", Drain(epoch=0))
        assert not answer.reporting and answer.seconds_since_attempt is not None
