"""Readiness after a real step: an agent announces itself only once its engine served a warm-up request.

A normal agent's warm-up leaves every block free, publishes no token and logs no request; an
agent whose engine's first step raises or kills the process (``--fault-first-step``) is never
announced (no ``InstanceJoined``, no load report: the scheduler never learns of it), serves no
RPC, writes no ready file, and ``shoal agent`` ends non-zero naming the failure.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from agents.agent import Agent
from agents.config import FaultPlan, FirstStepFault
from agents.engines.protocol import StepResult
from agents.engines.sim import SimEngine
from agents.warm_up import WARM_UP_PROMPT, WARM_UP_REQUEST_ID, WarmUpFailed, warm_up
from bus import JetStreamBus, NoResponders
from schemas import GenerateRequest, InstanceJoined, RequestAdmitted
from tests.agents.agent_cluster import (
    AgentCluster,
    agent_cluster,
    bus_config,
    fast_agent_config,
    greedy,
    sim_engine,
)

#: how long an agent that cannot step may take to end (a sim agent starts in about a second)
_EXIT_BOUND_S = 60.0


async def _registry(cluster: AgentCluster, instance_id: str) -> tuple[list[Any], list[Any]]:
    """What a scheduler would fold about ``instance_id``: its instance events and its load reports."""
    events = [e.body for _, e in await cluster.stored(cluster.subjects.instance(instance_id))]
    loads = [
        e.body
        for _, e in await cluster.stored(cluster.subjects.load(instance_id), cluster.subjects.loads_stream)
    ]
    return events, loads


async def _collect(feed: Any, subjects: list[str]) -> None:
    async for message in feed:
        subjects.append(message.subject)


@pytest.mark.unit
async def test_warm_up_runs_a_prefill_and_a_decode_step_and_leaves_the_pool_as_it_was() -> None:
    engine = sim_engine(num_blocks=16)
    done = await warm_up(engine, lambda: engine.step_async(exclusive=True), timeout_s=10)
    assert len(done.token_ids) == 2 and done.num_steps >= 2
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks == 16 and not stats.requests
    assert not engine.has_unfinished() and engine.take_events() == []


@pytest.mark.unit
async def test_warm_up_leaves_nothing_in_the_prefix_cache_for_a_client_to_hit() -> None:
    engine = SimEngine("tiny-test", num_blocks=16, prefix_cache=True)
    await warm_up(engine, lambda: engine.step_async(exclusive=True), timeout_s=10)
    stats = engine.stats()
    assert engine.cached_block_hashes() == [] and stats.num_cached_blocks == 0
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    engine.add_request("client", list(WARM_UP_PROMPT) * 4, greedy(2))  # starts as the warm-up's did
    while engine.has_unfinished():
        outputs = engine.step().outputs
        assert all(o.num_cached_tokens == 0 for o in outputs)


@pytest.mark.unit
async def test_a_warm_up_that_leaves_a_block_held_fails() -> None:
    engine = sim_engine(num_blocks=16)

    async def leaky_step() -> StepResult:
        if engine.stats().num_reserved_blocks == 0:
            engine.reserve(1)  # an engine whose pool loses a block on the way
        return await engine.step_async(exclusive=True)

    with pytest.raises(WarmUpFailed, match="1 block"):
        await warm_up(engine, leaky_step, timeout_s=10)


@pytest.mark.unit
async def test_a_warm_up_whose_step_raises_fails_naming_the_error() -> None:
    engine = sim_engine(num_blocks=16)

    async def broken_step() -> StepResult:
        raise RuntimeError("kernel says no")

    with pytest.raises(WarmUpFailed, match="RuntimeError: kernel says no"):
        await warm_up(engine, broken_step, timeout_s=10)


async def test_a_ready_agent_warmed_up_without_a_trace_a_client_sees(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        seen: list[str] = []
        prefix = cluster.subjects.prefix
        feeds = [await cluster.bus.subscribe(f"{prefix}.{kind}.>") for kind in ("tok", "tokb")]
        collectors = [asyncio.create_task(_collect(feed, seen)) for feed in feeds]
        engine = sim_engine(num_blocks=32)
        agent = await cluster.add(engine, fast_agent_config("warm1"))
        stats = engine.stats()
        assert stats.num_finished == 1  # the warm-up request ran before the agent was announced
        assert stats.num_free_blocks == stats.num_total_blocks == 32 and not stats.requests
        assert agent.num_steps == 0 and agent.num_accepted == 0  # not a client's request
        reply = await cluster.generate("warm1", GenerateRequest(request_id="r1", token_ids=(5, 6, 7),
                                                                sampling=greedy(4)))
        assert reply.accepted
        async with asyncio.timeout(10):
            while engine.has_unfinished() or engine.stats().num_finished < 2:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # the last deltas and events on their way
        for feed, collector in zip(feeds, collectors, strict=True):
            await feed.unsubscribe()
            await asyncio.wait_for(collector, 5)
        assert set(seen) == {cluster.subjects.tok("r1")}  # the client's request's tokens only
        requests = await cluster.stored(f"{cluster.subjects.prefix}.ev.req.>")
        assert {s for s, _ in requests} == {cluster.subjects.req("r1")}
        assert not [e for _, e in requests if isinstance(e.body, RequestAdmitted)
                    and e.body.request_id == WARM_UP_REQUEST_ID]
        events, loads = await _registry(cluster, "warm1")
        assert isinstance(events[0], InstanceJoined) and loads


async def test_an_agent_whose_first_step_raises_is_never_announced(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        config = fast_agent_config("broken1", faults=FaultPlan(first_step=FirstStepFault.RAISE))
        bus = JetStreamBus(bus_config(nats_url, cluster.subjects, "broken1"))
        await bus.connect()
        try:
            with pytest.raises(WarmUpFailed, match="first step raised"):
                await Agent(sim_engine(), bus, config).start()
        finally:
            await bus.close()
        events, loads = await _registry(cluster, "broken1")
        assert events == [] and loads == []
        with pytest.raises(NoResponders):
            await cluster.generate("broken1", GenerateRequest(request_id="r1", token_ids=(5, 6),
                                                              sampling=greedy(2)), timeout=2)


def _agent_argv(nats_url: str, prefix: str, instance_id: str, ready: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-c", "from frontend.cli import main; main()", "agent",
        "--engine", "sim", "--nats", nats_url, "--prefix", prefix, "--instance-id", instance_id,
        "--transport", "tcp", "--ready-file", str(ready), "--log-level", "INFO", *extra,
    ]


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("fault", "status", "says"),
    [
        ("raise", 1, "never became ready: the engine's step failed on the warm-up request"),
        ("exit", -signal.SIGILL, "warm-up request (sim engine, float32); a process that dies now"),
    ],
)
async def test_shoal_agent_whose_engine_cannot_step_ends_and_is_never_ready(
    nats_url: str, tmp_path: Path, fault: str, status: int, says: str
) -> None:
    async with agent_cluster(nats_url) as cluster:
        ready = tmp_path / "ready.json"
        process = await asyncio.create_subprocess_exec(
            *_agent_argv(nats_url, cluster.subjects.prefix, "cannot", ready, "--fault-first-step", fault),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=tmp_path,
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), _EXIT_BOUND_S)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise AssertionError(f"--fault-first-step {fault}: running after {_EXIT_BOUND_S} s") from None
        text = output.decode()
        assert process.returncode == status, text
        assert says in text
        assert not ready.exists()
        events, loads = await _registry(cluster, "cannot")
        assert events == [] and loads == []
        assert not list(tmp_path.glob("core*"))  # the simulated crash leaves no core file


@pytest.mark.e2e
async def test_shoal_agent_without_a_fault_is_ready_after_its_warm_up(nats_url: str, tmp_path: Path) -> None:
    async with agent_cluster(nats_url) as cluster:
        ready = tmp_path / "ready.json"
        process = await asyncio.create_subprocess_exec(
            *_agent_argv(nats_url, cluster.subjects.prefix, "fine", ready),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        try:
            async with asyncio.timeout(_EXIT_BOUND_S):
                while not ready.exists():
                    assert process.returncode is None, "the agent ended before it was ready"
                    await asyncio.sleep(0.05)
            events, _ = await _registry(cluster, "fine")
            assert isinstance(events[0], InstanceJoined)
        finally:
            process.send_signal(signal.SIGINT)
            output, _ = await asyncio.wait_for(process.communicate(), 20)
        assert process.returncode == 0, output.decode()
        assert "warm-up request served (2 tokens" in output.decode()


def test_the_fault_option_is_in_the_agents_fault_plan_and_renders_back() -> None:
    import click

    from agents.cli import fault_plan
    from agents.engines.agent_cli import AgentCliConfig
    from bus.cli_config import from_argv, to_argv

    options = from_argv(AgentCliConfig, ["--fault-first-step", "exit"])
    assert fault_plan(options.faults).first_step is FirstStepFault.EXIT
    assert "--fault-first-step" in to_argv(options)  # what shoal up and the drills pass to their agents
    assert fault_plan(from_argv(AgentCliConfig, []).faults).first_step is None
    with pytest.raises(click.BadParameter):
        from_argv(AgentCliConfig, ["--fault-first-step", "later"])
