"""Abort paths of live migration between two agents of a real engine (torch and vllm) on a real nats-server.

``test_faults`` walks every abort path with sim engines; here the paths that
depend on the engine's own bookkeeping run on the torch engine and on vLLM:
the request finishes while a stage's copy is under way, the request is
preempted meanwhile, the source or the destination dies. After each, the
surviving engines' free block counts are where they started, no block stays
reserved, and the request finishes exactly once (or, when its source died,
never on the destination). ``FaultPlan.copy_gate`` holds each stage's copy until
the test has acted and ``FaultPlan.pace`` holds the source's engine to a slowest
pace meanwhile, so what each test arranges happens whatever the engine's speed.
Engines are built fresh per test (a killed agent leaves its engine behind); the
vLLM ones share one checkpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agents.agent import Agent, AgentConfig, FaultPlan, StepPace
from agents.engines.vllm_engine import vllm_unavailable_reason
from schemas import GenerateRequest, SamplingParams
from schemas.reasons import MigrationAbortReason
from tests.agents.agent_cluster import TokenWatcher, agent_cluster, fast_agent_config, unmigrated_tokens

_VLLM_REASON = vllm_unavailable_reason()
pytestmark = pytest.mark.filterwarnings(  # vLLM's import warns about its own dependencies
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning", "ignore::RuntimeWarning"
)

BLOCK_SIZE = 32
NUM_BLOCKS = 48
PROMPT = tuple((i * 37) % 300 + 3 for i in range(150))  # 4 full blocks: stage 0 is not the last stage
#: the source's slowest pace while a test acts: a request of n more tokens lasts >= n * PACE_S
PACE_S = 0.02
#: a held copy waits for its gate this long at most (the copy timeout; the destination's idle timeout too)
HOLD_LIMIT_S = 30.0

MakeEngine = Callable[..., Any]


@pytest.fixture(scope="module")
def vllm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agents.engines.vllm_engine.checkpoint import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("llama"))


@pytest.fixture(
    params=[
        "torch",
        pytest.param("vllm", marks=pytest.mark.skipif(_VLLM_REASON is not None, reason=_VLLM_REASON or "")),
    ]
)
def make_engine(request: pytest.FixtureRequest) -> Iterator[MakeEngine]:
    """``make_engine(num_blocks=48)``: a fresh engine of the parameter's kind (vLLM ones shut down after)."""
    built: list[Any] = []

    def make(num_blocks: int = NUM_BLOCKS) -> Any:
        if request.param == "torch":
            from agents.engines.torch_engine import TorchEngine

            engine: Any = TorchEngine(
                "tiny", num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=512, batch_invariant=True
            )
        else:
            from agents.engines.vllm_engine.engine import VllmEngine

            checkpoint = request.getfixturevalue("vllm_checkpoint")
            engine = VllmEngine(
                str(checkpoint),
                num_blocks=num_blocks,
                kv_cache_bytes=64 * 2**20,
                max_model_len=512,
                dtype="float32",
            )
        built.append(engine)
        return engine

    yield make
    for engine in built:
        if hasattr(engine, "shutdown"):
            engine.shutdown()


def _unmigrated(make: MakeEngine, sampling: SamplingParams, prompt: tuple[int, ...] = PROMPT) -> list[int]:
    return unmigrated_tokens(make(), prompt, sampling)


class Hold:
    """A source's copies held until :meth:`release` (the copy gate), its engine paced meanwhile."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.pace = StepPace(PACE_S)
        self.faults = FaultPlan(copy_gate=self.gate, pace=self.pace)

    def release(self) -> None:
        self.gate.set()
        self.pace.release()


def _config(name: str, faults: FaultPlan | None = None, **migration: float) -> AgentConfig:
    config = fast_agent_config(name, faults=faults or FaultPlan())
    return replace(config, migration=replace(config.migration, **migration)) if migration else config


async def _start(
    cluster: Any,
    request_id: str,
    sampling: SamplingParams,
    prompt: tuple[int, ...] = PROMPT,
    instance: str = "s",
    min_tokens: int = 8,
) -> TokenWatcher:
    watcher: TokenWatcher = await cluster.watch(request_id)
    request = GenerateRequest(request_id=request_id, token_ids=prompt, sampling=sampling)
    assert (await cluster.generate(instance, request)).accepted
    async with asyncio.timeout(30):
        while len(watcher.tokens()) < min_tokens:
            await asyncio.sleep(0.005)
    return watcher


async def _reserved_soon(agent: Agent) -> None:
    """Wait until stage 0 reserved its blocks on ``agent`` (its copy is then held by the gate)."""
    async with asyncio.timeout(5):
        while agent.engine.stats().num_reserved_blocks == 0:
            await asyncio.sleep(0.005)


async def _finished_once(watcher: TokenWatcher, expected: list[int] | None) -> list[int]:
    await watcher.wait_finished(timeout=60)
    await asyncio.sleep(0.2)  # a duplicate run would keep publishing
    tokens = watcher.tokens()  # no gap, no duplicate
    if expected is not None:
        assert tokens == expected
    assert sum(1 for d in watcher.deltas if d.finish_reason is not None) == 1
    await watcher.close()
    return tokens


async def _idle(*agents: Agent) -> None:
    async with asyncio.timeout(30):
        while any(a.engine.has_unfinished() or not a.migration.is_idle for a in agents):
            await asyncio.sleep(0.01)


def _settled(*agents: Agent, free: int = NUM_BLOCKS) -> None:
    for agent in agents:
        stats = agent.engine.stats()
        assert (stats.num_free_blocks, stats.num_reserved_blocks) == (free, 0), agent.instance_id


async def test_request_finishing_mid_copy_rolls_back(nats_url: str, make_engine: MakeEngine) -> None:
    sampling = SamplingParams(max_tokens=60, ignore_eos=True)  # 52 tokens after 8: >= 1 s paced
    expected = _unmigrated(make_engine, sampling)
    hold = Hold()
    async with agent_cluster(nats_url) as cluster:
        source = await cluster.add(make_engine(), _config("s", hold.faults, copy_timeout_s=HOLD_LIMIT_S))
        destination = await cluster.add(make_engine(), _config("d", destination_idle_timeout_s=HOLD_LIMIT_S))
        watcher = await _start(cluster, "ending", sampling)
        migration = asyncio.ensure_future(source.migrate("ending", "d"))
        await _reserved_soon(destination)
        await _finished_once(watcher, expected)  # finishes on the source while stage 0 waits to copy
        hold.release()
        outcome = await asyncio.wait_for(migration, 30)
        assert not outcome.migrated and outcome.reason is MigrationAbortReason.REQUEST_FINISHED
        assert {d.instance_id for d in watcher.deltas} == {"s"}
        await _idle(source, destination)
        _settled(source, destination)


async def test_request_preempted_mid_copy_rolls_back(nats_url: str, make_engine: MakeEngine) -> None:
    """Two requests outgrow a 20-block source; the newer one (the migrating one) is preempted mid-copy.

    Both engines preempt the newest running request when one needs a block and none is free. The two
    start on 12 + 5 blocks: the 3 free ones last about 40 steps, so "moving" is preempted while
    stage 0's copy is held; the test lets the copy go once it saw the preemption.
    """
    sampling = SamplingParams(max_tokens=300, ignore_eos=True)  # 150 + 300 tokens: 15 blocks
    filler = SamplingParams(max_tokens=120, ignore_eos=True)  # 384 + 120 tokens: 16 blocks
    filler_prompt = tuple((i * 11) % 300 + 3 for i in range(384))
    expected = _unmigrated(make_engine, sampling)
    hold = Hold()
    async with agent_cluster(nats_url) as cluster:
        source = await cluster.add(make_engine(20), _config("s", hold.faults, copy_timeout_s=HOLD_LIMIT_S))
        destination = await cluster.add(make_engine(), _config("d", destination_idle_timeout_s=HOLD_LIMIT_S))
        filler_watcher = await _start(cluster, "filler", filler, filler_prompt, min_tokens=1)
        watcher = await _start(cluster, "moving", sampling, min_tokens=1)
        migration = asyncio.ensure_future(source.migrate("moving", "d"))
        await _reserved_soon(destination)
        async with asyncio.timeout(30):
            while source.engine.stats().num_preemptions == 0:
                await asyncio.sleep(0.005)
        hold.release()
        outcome = await asyncio.wait_for(migration, 30)
        assert not outcome.migrated and outcome.reason is MigrationAbortReason.REQUEST_PREEMPTED
        assert source.engine.stats().num_preemptions >= 1
        tokens = await _finished_once(watcher, None)
        assert len(tokens) == sampling.max_tokens
        # greedy decoding recomputed after the preemption: the torch engine is batch-invariant, and
        # vLLM's prefill and decode kernels agree on this model (a divergence here is a real bug)
        assert tokens == expected
        await _finished_once(filler_watcher, None)
        assert {d.instance_id for d in watcher.deltas} == {"s"}
        await _idle(source, destination)
        _settled(source, free=20)
        _settled(destination)


async def test_destination_killed_mid_copy(nats_url: str, make_engine: MakeEngine) -> None:
    # the copy, let go once the destination is gone, fails while the paced request still runs
    sampling = SamplingParams(max_tokens=350, ignore_eos=True)
    expected = _unmigrated(make_engine, sampling)
    hold = Hold()
    async with agent_cluster(nats_url) as cluster:
        source = await cluster.add(make_engine(), _config("s", hold.faults, copy_timeout_s=HOLD_LIMIT_S))
        destination = await cluster.add(make_engine(), _config("d"))
        watcher = await _start(cluster, "moving", sampling)
        migration = asyncio.ensure_future(source.migrate("moving", "d"))
        await _reserved_soon(destination)
        await destination.kill()
        hold.gate.set()
        outcome = await asyncio.wait_for(migration, 30)
        hold.pace.release()
        assert not outcome.migrated and outcome.reason is MigrationAbortReason.COPY_FAILED
        await _finished_once(watcher, expected)
        assert {d.instance_id for d in watcher.deltas} == {"s"}
        await _idle(source)
        _settled(source)


async def test_source_killed_mid_copy_releases_the_reservation(
    nats_url: str, make_engine: MakeEngine
) -> None:
    sampling = SamplingParams(max_tokens=300, ignore_eos=True)  # paced: still running when killed
    hold = Hold()
    async with agent_cluster(nats_url) as cluster:
        source = await cluster.add(make_engine(), _config("s", hold.faults, copy_timeout_s=HOLD_LIMIT_S))
        destination = await cluster.add(make_engine(), _config("d", destination_idle_timeout_s=0.6))
        watcher = await _start(cluster, "moving", sampling)
        migration = asyncio.ensure_future(source.migrate("moving", "d"))
        await _reserved_soon(destination)
        await source.kill()
        migration.cancel()
        async with asyncio.timeout(10):  # the destination gives up after its idle timeout
            while destination.engine.stats().num_reserved_blocks:
                await asyncio.sleep(0.05)
        _settled(destination)
        assert not destination.engine.has_unfinished()  # not duplicated onto the destination
        await asyncio.sleep(0.3)
        tokens = watcher.tokens()
        assert watcher.deltas and watcher.deltas[-1].finish_reason is None  # it died with its source
        assert {d.owner_epoch for d in watcher.deltas} == {0} and len(tokens) < sampling.max_tokens
        await watcher.close()
