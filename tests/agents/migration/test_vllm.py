"""Live migration between two vllm-engine agents on a real nats-server (the vLLM twin of ``test_torch``).

A greedy request migrated in at least two stages while other requests decode
on both instances, over TCP and over UCX, must produce exactly the tokens of
an unmigrated run, finish once, and a subscriber must see no gap and no duplicate across the move; free
block counts on both engines end where they started. A destination without
room aborts the migration at pre-allocation and the request finishes on its
source. A lost or repeated handshake message either still migrates or rolls
back, with the same tokens and free counts. The source is paced (``StepPace``)
until the migration's outcome, so the request is still running when each test
acts however fast the engine is. Skipped (with the reason) where vLLM is not
installed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agents.agent import FaultPlan, StepPace
from agents.engines.vllm_engine import vllm_unavailable_reason
from agents.engines.vllm_engine.checkpoint import build_checkpoint
from schemas import GenerateRequest, SamplingParams
from schemas.reasons import MigrationAbortReason
from tests.agents.agent_cluster import agent_cluster, fast_agent_config, unmigrated_tokens
from transport import TransportConfig
from transport.ucx import ucx_available

_REASON = vllm_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=_REASON or ""),
    # vLLM's import and start-up warn about its own dependencies (torch.jit, torch.distributed, ...)
    pytest.mark.filterwarnings(
        "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning"
    ),
]

NUM_BLOCKS = 48
GREEDY = SamplingParams(max_tokens=400, ignore_eos=True)  # 470 tokens
PROMPT = tuple((i * 37) % 500 + 3 for i in range(70))
#: the source's slowest pace until the outcome: the 370 tokens left after the migration starts last >= 3.7 s
PACE_S = 0.01


def _engine(checkpoint: Path, num_blocks: int = NUM_BLOCKS, max_model_len: int = 512) -> Any:
    from agents.engines.vllm_engine.engine import VllmEngine

    return VllmEngine(
        str(checkpoint),
        num_blocks=num_blocks,
        kv_cache_bytes=64 * 2**20,
        max_model_len=max_model_len,
        dtype="float32",
    )


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Any]]:
    """Two 48-block engines and a 2-block one (too small for a migrated request), shared by the tests.

    vLLM wants room for one request of the model's full length, so the small one serves 64 tokens.
    """
    checkpoint = build_checkpoint(tmp_path_factory.mktemp("llama"))
    small = _engine(checkpoint, num_blocks=2, max_model_len=64)
    built = (_engine(checkpoint), _engine(checkpoint), small)
    yield built
    for engine in built:
        engine.shutdown()


def _unmigrated(engine: Any) -> list[int]:
    return unmigrated_tokens(engine, PROMPT, GREEDY)


async def _idle(*agents: Any) -> None:
    async with asyncio.timeout(30):
        while any(a.engine.has_unfinished() or not a.migration.is_idle for a in agents):
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("kind", ["tcp", "ucx"])
async def test_migrated_request_matches_an_unmigrated_run(nats_url: str, engines: Any, kind: str) -> None:
    if kind == "ucx" and (reason := ucx_available()) is not None:
        pytest.fail(f"UCX must be exercised here but is unavailable: {reason}")
    transport = TransportConfig(kind=kind, ucx_tls="tcp" if kind == "ucx" else "", send_timeout_s=5.0)
    first, second, _ = engines
    expected = _unmigrated(first)
    assert first.stats().num_free_blocks == NUM_BLOCKS == second.stats().num_free_blocks
    pace = StepPace(PACE_S)
    async with agent_cluster(nats_url) as cluster:
        config = fast_agent_config("v1", faults=FaultPlan(pace=pace))
        # nothing is lost here, so a generous ack timeout: a UCX endpoint's first handshake on a
        # loaded machine took longer than the 0.5 s the message-loss tests use
        config = replace(config, transport=transport, migration=replace(config.migration, ack_timeout_s=3.0))
        a1 = await cluster.add(first, config)
        a2 = await cluster.add(second, replace(fast_agent_config("v2"), transport=transport))
        assert a1.transport.kind == kind
        for instance, name in (("v1", "bg1"), ("v2", "bg2")):  # co-located requests decode on both sides
            background = GenerateRequest(
                request_id=name, token_ids=(3, 4, 5), sampling=SamplingParams(max_tokens=150, ignore_eos=True)
            )
            assert (await cluster.generate(instance, background)).accepted
        watcher = await cluster.watch("moving")
        request = GenerateRequest(request_id="moving", token_ids=PROMPT, sampling=GREEDY)
        assert (await cluster.generate("v1", request)).accepted
        await watcher.wait_tokens(30)  # 100 tokens: the request holds 4 blocks, 3 of them full
        outcome = await a1.migrate("moving", "v2")
        pace.release()
        assert outcome.migrated, outcome.reason
        assert outcome.num_stages >= 2
        await watcher.wait_finished(timeout=60)
        await asyncio.sleep(0.2)  # a duplicate run would keep publishing
        assert watcher.tokens() == expected
        assert sum(1 for d in watcher.deltas if d.finish_reason is not None) == 1
        assert {d.owner_epoch for d in watcher.deltas} == {0, 1}
        assert {d.instance_id for d in watcher.deltas} == {"v1", "v2"}
        await watcher.close()
        await _idle(a1, a2)
        assert a1.engine.stats().num_free_blocks == NUM_BLOCKS == a2.engine.stats().num_free_blocks
        assert a2.engine.stats().num_reserved_blocks == 0
        assert a1.transport.stats().transfers_sent == outcome.num_stages
        assert a2.transport.stats().transfers_received == outcome.num_stages


async def test_a_destination_caching_the_prompt_receives_only_the_blocks_after_it(
    nats_url: str, engines: Any
) -> None:
    """vLLM's prefix cache on both agents: a destination that served the prompt lends its cached
    blocks to the migration (found by shoal's chain hashes), only the blocks after them travel, and
    the request gives the unmigrated tokens."""
    first, second, _ = engines
    expected = _unmigrated(first)
    pace = StepPace(PACE_S)
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(first, fast_agent_config("v1", faults=FaultPlan(pace=pace)))
        a2 = await cluster.add(second, fast_agent_config("v2"))
        earlier = await cluster.watch("earlier")  # v2 computes and caches the prompt's 2 full blocks
        short = SamplingParams(max_tokens=2, ignore_eos=True)
        assert (
            await cluster.generate(
                "v2", GenerateRequest(request_id="earlier", token_ids=PROMPT, sampling=short)
            )
        ).accepted
        await earlier.wait_finished(timeout=30)
        watcher = await cluster.watch("moving")
        request = GenerateRequest(request_id="moving", token_ids=PROMPT, sampling=GREEDY)
        assert (await cluster.generate("v1", request)).accepted
        await watcher.wait_tokens(30)  # 100 tokens: 3 full blocks
        outcome = await a1.migrate("moving", "v2")
        pace.release()
        assert outcome.migrated, outcome.reason
        bytes_per_block = a1.engine.info.bytes_per_block
        copied = sum(stage.num_blocks for stage in outcome.stages)
        assert outcome.num_cached_blocks == 2 and outcome.bytes_saved == 2 * bytes_per_block
        assert a1.transport.stats().bytes_sent == copied * bytes_per_block
        await watcher.wait_finished(timeout=60)
        assert watcher.tokens() == expected
        assert {d.owner_epoch for d in watcher.deltas} == {0, 1}
        for stream in (earlier, watcher):
            await stream.close()
        await _idle(a1, a2)
        assert a1.engine.stats().num_free_blocks == NUM_BLOCKS == a2.engine.stats().num_free_blocks
        assert a2.engine.stats().num_reserved_blocks == 0


@pytest.mark.parametrize("abort_lost", [False, True], ids=["abort-arrives", "abort-lost"])
async def test_destination_out_of_blocks_aborts_and_the_request_finishes_on_its_source(
    nats_url: str, engines: Any, abort_lost: bool
) -> None:
    """The destination's refusal aborts at pre-allocation; lost, the source's ack timeout does."""
    first, _, small = engines
    expected = _unmigrated(first)
    refusal = FaultPlan(drop_outgoing=frozenset({"Abort"})) if abort_lost else FaultPlan()
    pace = StepPace(PACE_S)
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(first, fast_agent_config("v1", faults=FaultPlan(pace=pace)))
        a3 = await cluster.add(small, fast_agent_config("v3", faults=refusal))
        watcher = await cluster.watch("stuck")
        request = GenerateRequest(request_id="stuck", token_ids=PROMPT, sampling=GREEDY)
        assert (await cluster.generate("v1", request)).accepted
        await watcher.wait_tokens(30)
        outcome = await a1.migrate("stuck", "v3")
        pace.release()
        reason = MigrationAbortReason.ACK_TIMEOUT if abort_lost else MigrationAbortReason.OUT_OF_BLOCKS
        assert not outcome.migrated and outcome.reason is reason
        assert a3.engine.stats().num_free_blocks == 2 and a3.engine.stats().num_reserved_blocks == 0
        await watcher.wait_finished(timeout=60)
        await asyncio.sleep(0.2)
        assert watcher.tokens() == expected
        assert sum(1 for d in watcher.deltas if d.finish_reason is not None) == 1
        assert {d.instance_id for d in watcher.deltas} == {"v1"}
        await watcher.close()
        await _idle(a1, a3)
        assert a1.engine.stats().num_free_blocks == NUM_BLOCKS
        assert a3.engine.stats().num_free_blocks == 2


#: (message type, the agent that drops or repeats it, fault, whether the migration still succeeds): every
#: handshake message lost and repeated once, as test_faults runs on sim engines. On vLLM engines the
#: repeats matter most: a second PreAllocate must not reserve twice, a second Commit must not admit twice.
MESSAGE_FAULTS = [
    ("PreAllocate", "v1", "drop", False),
    ("PreAllocate", "v1", "duplicate", True),
    ("Ack", "v2", "drop", False),
    ("Ack", "v2", "duplicate", True),
    ("StageDone", "v1", "drop", True),
    ("StageDone", "v1", "duplicate", True),
    ("Commit", "v1", "drop", False),
    ("Commit", "v1", "duplicate", True),
    ("CommitAck", "v2", "drop", True),
    ("CommitAck", "v2", "duplicate", True),
]


@pytest.mark.parametrize(("message", "faulty", "fault", "migrates"), MESSAGE_FAULTS)
async def test_lost_or_repeated_handshake_message(
    nats_url: str, engines: Any, message: str, faulty: str, fault: str, migrates: bool
) -> None:
    """Every rollback path on vLLM engines: the request finishes once with the unmigrated tokens."""
    first, second, _ = engines
    expected = _unmigrated(first)
    plan = FaultPlan(**{f"{fault}_outgoing": frozenset({message})}, max_faults=1)
    pace = StepPace(PACE_S)
    async with agent_cluster(nats_url) as cluster:
        agents = {}
        for name, engine in (("v1", first), ("v2", second)):
            faults = plan if name == faulty else FaultPlan()
            if name == "v1":
                faults = replace(faults, pace=pace)
            agents[name] = await cluster.add(engine, fast_agent_config(name, faults=faults))
        a1, a2 = agents["v1"], agents["v2"]
        watcher = await cluster.watch("faulty")
        request = GenerateRequest(request_id="faulty", token_ids=PROMPT, sampling=GREEDY)
        assert (await cluster.generate("v1", request)).accepted
        await watcher.wait_tokens(30)
        outcome = await a1.migrate("faulty", "v2")
        pace.release()
        assert agents[faulty].migration.faults_applied, "the fault was not injected"
        assert outcome.migrated is migrates, outcome.reason
        await watcher.wait_finished(timeout=60)
        await asyncio.sleep(0.2)
        assert watcher.tokens() == expected
        assert sum(1 for d in watcher.deltas if d.finish_reason is not None) == 1
        assert {d.owner_epoch for d in watcher.deltas} == ({0, 1} if migrates else {0})
        await watcher.close()
        await _idle(a1, a2)
        assert a1.engine.stats().num_free_blocks == NUM_BLOCKS == a2.engine.stats().num_free_blocks
        assert a1.engine.stats().num_reserved_blocks == 0 == a2.engine.stats().num_reserved_blocks


async def test_a_queued_request_moves_without_kv(nats_url: str, engines: Any) -> None:
    """The scheduler's ``MoveQueued`` on vLLM agents: a request waiting for blocks in vLLM's queue
    moves without KV (held out of the queue, zero-block stage, commit) and gives the unmoved tokens."""
    from schemas import MoveQueued

    first, second, _ = engines
    expected = _unmigrated(second)
    pace = StepPace(0.03)  # the fillers' last 31 steps, while they hold every block, last >= 0.9 s
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(first, fast_agent_config("v1", faults=FaultPlan(pace=pace)))
        a2 = await cluster.add(second, fast_agent_config("v2"))
        for index in range(3):  # 480-token prompts: 16 blocks each once they decode, every block
            prompt = tuple(3 + (i * 7 + index) % 400 for i in range(480))
            fill = GenerateRequest(
                request_id=f"fill{index}",
                token_ids=prompt,
                sampling=SamplingParams(max_tokens=32, ignore_eos=True),
            )
            assert (await cluster.generate("v1", fill)).accepted
        async with asyncio.timeout(30):
            while a1.engine.stats().num_free_blocks > 0:
                await asyncio.sleep(0.005)
        watcher = await cluster.watch("moving")
        request = GenerateRequest(request_id="moving", token_ids=PROMPT, sampling=GREEDY)
        assert (await cluster.generate("v1", request)).accepted
        reply = await cluster.call(
            "v1", "move_queued", MoveQueued(epoch=1, request_id="moving", destination_id="v2")
        )
        assert reply.accepted, reply
        async with asyncio.timeout(30):
            while not (outcomes := [o for o in a1.migration.outcomes if o.request_id == "moving"]):
                await asyncio.sleep(0.005)
        pace.release()
        outcome = outcomes[0]
        await watcher.wait_finished(timeout=60)
        await asyncio.sleep(0.2)
        assert outcome.migrated and outcome.stages == [], outcome.reason
        assert watcher.tokens() == expected
        assert sum(1 for d in watcher.deltas if d.finish_reason is not None) == 1
        assert {(d.instance_id, d.owner_epoch) for d in watcher.deltas} == {("v2", 1)}
        await watcher.close()
        await _idle(a1, a2)
        assert a1.engine.stats().num_free_blocks == NUM_BLOCKS == a2.engine.stats().num_free_blocks
