"""Live migration between two sim-engine agents on a real nats-server: the happy path and its record."""

from __future__ import annotations

import asyncio

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agents.engines.sim import sim_token_id
from schemas import Commit, CommitAck, GenerateRequest, PreAllocate
from tests.agents.agent_cluster import agent_cluster, fast_agent_config, greedy, sim_engine


async def test_live_migration_keeps_the_token_stream_whole(nats_url: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(sim_engine(time_scale=3.0), fast_agent_config("a1"), tracer_provider=provider)
        a2 = await cluster.add(sim_engine(time_scale=3.0), fast_agent_config("a2"), tracer_provider=provider)
        free_before = a2.engine.stats().num_free_blocks
        watcher = await cluster.watch("r1")
        prompt = tuple(range(1, 41))
        reply = await cluster.generate(
            "a1", GenerateRequest(request_id="r1", token_ids=prompt, sampling=greedy(120))
        )
        assert reply.accepted
        await watcher.wait_tokens(20)
        outcome = await a1.migrate("r1", "a2")
        assert outcome.migrated, outcome.reason
        assert outcome.num_stages >= 2  # stage 0 while decoding, then the last stage
        # the request is suspended for the last stage only, which copies what the earlier ones left
        first, last = outcome.stages[0], outcome.stages[-1]
        assert last.num_blocks <= a1.config.migration.last_stage_max_blocks < first.num_blocks
        assert outcome.downtime_s is not None and outcome.downtime_s > 0
        await watcher.wait_finished()
        tokens = watcher.tokens()
        assert tokens == [sim_token_id("r1", None, i, 1000, 0) for i in range(120)]
        epochs = watcher.epochs()
        assert epochs == sorted(epochs) and epochs[0] == 0 and epochs[-1] == 1
        assert {d.instance_id for d in watcher.deltas if d.owner_epoch == 1} == {"a2"}
        await asyncio.sleep(0.1)
        assert a1.engine.stats().num_free_blocks == 64
        assert a2.engine.stats().num_free_blocks == free_before
        await watcher.close()

        events = await cluster.stored(f"{cluster.subjects.prefix}.ev.mig.{outcome.migration_id}.>")
        events += await cluster.stored(cluster.subjects.mig(outcome.migration_id))
        bodies = [env.body for _, env in events]
        assert any(isinstance(b, PreAllocate) for b in bodies)
        assert any(isinstance(b, Commit) for b in bodies)
        outcomes = [env.body for subject, env in events if subject.endswith(".outcome")]
        assert len(outcomes) == 1 and isinstance(outcomes[0], CommitAck)
        assert all(env.time > 0 and env.producer in ("a1", "a2") for _, env in events)

    spans = exporter.get_finished_spans()
    source = [s for s in spans if s.name == "migration"]
    destination = [s for s in spans if s.name == "migration.destination"]
    stages = [s for s in spans if s.name == "migration.stage"]
    assert len(source) == 1 and len(destination) == 1 and len(stages) == outcome.num_stages
    assert destination[0].context.trace_id == source[0].context.trace_id
    assert destination[0].parent is not None and destination[0].parent.span_id == source[0].context.span_id
    assert source[0].attributes["shoal.migration.outcome"] == "migrated"
    assert all(s.parent.span_id == source[0].context.span_id for s in stages)
    assert all(s.attributes["shoal.migration.bytes"] > 0 for s in stages)
