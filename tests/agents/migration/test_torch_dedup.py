"""Prefix-cached blocks and moving requests, on the torch engine (a real model, batch-invariant).

A live migration to an instance that caches the request's prompt copies only the blocks
after it, and the request's greedy text equals an unmigrated run's; the request that shared
the migrating one's prompt blocks on the source keeps decoding correctly after the source
released them. A request rescued by recompute onto an instance that cached its prompt
computes only the rest (``num_cached_tokens``), with the same text.
"""

from __future__ import annotations

import asyncio

from msgspec.structs import replace

from agents.agent import Agent, FaultPlan, StepPace
from agents.engines.torch_engine import TorchEngine
from schemas import GenerateRequest, SamplingParams
from schemas.block_hash import block_hashes
from tests.agents.agent_cluster import agent_cluster, fast_agent_config, unmigrated_tokens

GREEDY = SamplingParams(max_tokens=200, ignore_eos=True)
PROMPT = tuple((i * 37) % 300 + 1 for i in range(70))  # 4 full blocks of 16 tokens and 6 more
NUM_BLOCKS = 48
#: the source's slowest pace until the outcome, so neither request finishes before the move
PACE_S = 0.01


def _engine() -> TorchEngine:
    return TorchEngine("tiny", num_blocks=NUM_BLOCKS, batch_invariant=True)


def _torch(agent: Agent) -> TorchEngine:
    engine = agent.engine
    assert isinstance(engine, TorchEngine)
    return engine


async def test_migration_to_a_cached_prefix_copies_the_rest_and_keeps_the_text(nats_url: str) -> None:
    expected = unmigrated_tokens(_engine(), PROMPT, GREEDY, "reference")
    pace = StepPace(PACE_S)
    async with agent_cluster(nats_url) as cluster:
        t1 = await cluster.add(_engine(), fast_agent_config("t1", faults=FaultPlan(pace=pace)))
        t2 = await cluster.add(_engine(), fast_agent_config("t2"))
        warm = await cluster.watch("warm")  # t2 computes and caches the prompt
        short = replace(GREEDY, max_tokens=2)
        assert (
            await cluster.generate("t2", GenerateRequest(request_id="warm", token_ids=PROMPT, sampling=short))
        ).accepted
        await warm.wait_finished(timeout=60)
        watchers = {name: await cluster.watch(name) for name in ("sharer", "moving")}
        sharer = GenerateRequest(request_id="sharer", token_ids=PROMPT, sampling=GREEDY)
        assert (await cluster.generate("t1", sharer)).accepted
        await watchers["sharer"].wait_tokens(1)
        moving = GenerateRequest(request_id="moving", token_ids=PROMPT, sampling=GREEDY)
        assert (await cluster.generate("t1", moving)).accepted
        await watchers["moving"].wait_tokens(20)  # 90 tokens: 5 full blocks
        scheduler1 = _torch(t1).scheduler
        shared = scheduler1.request("moving").block_ids[:4]
        assert shared == scheduler1.request("sharer").block_ids[:4]  # its prompt's blocks on t1
        assert all(scheduler1.blocks.ref_count(b) == 2 for b in shared)
        sent_before = t1.transport.stats().bytes_sent
        outcome = await t1.migrate("moving", "t2")
        pace.release()
        assert outcome.migrated, outcome.reason
        bytes_per_block = t1.engine.info.bytes_per_block
        copied = sum(stage.num_blocks for stage in outcome.stages)
        assert outcome.num_cached_blocks == 4 and outcome.bytes_saved == 4 * bytes_per_block
        assert t1.transport.stats().bytes_sent - sent_before == copied * bytes_per_block
        scheduler2 = _torch(t2).scheduler
        table = scheduler2.request("moving").block_ids
        assert [scheduler2.blocks.block_hash(b) for b in table[:4]] == block_hashes(PROMPT, 16)
        for watcher in watchers.values():
            await watcher.wait_finished(timeout=120)
        assert watchers["moving"].tokens() == expected
        assert {d.owner_epoch for d in watchers["moving"].deltas} == {0, 1}
        assert watchers["sharer"].tokens() == expected  # its blocks stayed on t1
        for watcher in (warm, *watchers.values()):
            await watcher.close()
        async with asyncio.timeout(30):
            while t1.engine.has_unfinished() or t2.engine.has_unfinished():
                await asyncio.sleep(0.01)
        for scheduler in (scheduler1, scheduler2):
            scheduler.blocks.check_invariants()
            assert scheduler.blocks.num_free_blocks == NUM_BLOCKS
            assert scheduler.blocks.num_reserved_blocks == 0


def _finish(engine: TorchEngine, request_id: str) -> tuple[list[int], int]:
    """Step ``engine`` until ``request_id`` finished: its tokens and its first output's cached tokens."""
    tokens: list[int] = []
    cached = -1
    while request_id in engine.scheduler:
        for output in engine.step().outputs:
            if output.request_id == request_id:
                cached = output.num_cached_tokens if cached < 0 else cached
                tokens.extend(output.token_ids)
    return tokens, cached


def test_a_rescued_request_computes_only_what_the_new_instance_lacks() -> None:
    sampling = replace(GREEDY, max_tokens=40)
    expected = unmigrated_tokens(_engine(), PROMPT, sampling, "r")
    generated = tuple(expected[:10])  # what the failed instance streamed before it died
    cold = _engine()
    cold.add_request("r", PROMPT, sampling, output_token_ids=generated)
    tokens, cached = _finish(cold, "r")
    assert cached == 0 and tokens == expected[10:]
    warm = _engine()
    unmigrated_tokens(warm, PROMPT, replace(GREEDY, max_tokens=2), "earlier")  # caches the prompt
    warm.add_request("r", PROMPT, sampling, output_token_ids=generated)
    tokens, cached = _finish(warm, "r")
    assert cached == 64  # the prompt's 4 full blocks
    assert tokens == expected[10:]
