"""Every abort path of live migration, between two sim-engine agents on a real nats-server.

After each: free blocks on the surviving agents return to their level before
the migration, and the request either completed exactly once (one finish, every
token index once, the tokens an unmigrated run gives) or is reported failed —
never duplicated. Faults are injected through the agent config's
:class:`~agents.config.FaultPlan` (drop / duplicate a handshake message by type,
slow the stage copies) and by killing an agent abruptly (``Agent.kill``).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from agents.agent import Agent, AgentConfig, FaultPlan, MigrationOutcome
from agents.engines.sim import sim_token_id
from agents.migration.fsm.config import MigrationConfig
from schemas import Abort, CommitAck, GenerateRequest, MigrationAbortReason
from tests.agents.agent_cluster import (
    AgentCluster,
    TokenWatcher,
    agent_cluster,
    fast_agent_config,
    greedy,
    sim_engine,
)

PROMPT = tuple(range(1, 41))  # 10 full blocks of 4 tokens
MAX_TOKENS = 180


def _expected(request_id: str) -> list[int]:
    return [sim_token_id(request_id, None, i, 1000, 0) for i in range(MAX_TOKENS)]


async def _start(cluster: AgentCluster, request_id: str = "r1", instance: str = "a1") -> TokenWatcher:
    watcher = await cluster.watch(request_id)
    request = GenerateRequest(request_id=request_id, token_ids=PROMPT, sampling=greedy(MAX_TOKENS))
    assert (await cluster.generate(instance, request)).accepted
    while len(watcher.tokens()) < 8:
        await asyncio.sleep(0.005)
    return watcher


async def _settle(*agents: Agent) -> None:
    async with asyncio.timeout(10):
        while any(a.engine.has_unfinished() or not a.migration.is_idle for a in agents):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)


async def _finished_once(watcher: TokenWatcher, request_id: str = "r1") -> None:
    await watcher.wait_finished(timeout=10)
    await asyncio.sleep(0.1)  # a duplicate run would keep publishing
    assert watcher.tokens() == _expected(request_id)
    assert sum(1 for d in watcher.deltas if d.finish_reason is not None) == 1
    await watcher.close()


async def _outcomes_logged(cluster: AgentCluster, outcome: MigrationOutcome) -> list[object]:
    stored = await cluster.stored(f"{cluster.subjects.mig(outcome.migration_id)}.outcome")
    return [env.body for _, env in stored]


NO_FAULTS = FaultPlan()


def _config(name: str, faults: FaultPlan = NO_FAULTS, **migration: float) -> AgentConfig:
    config = fast_agent_config(name, faults=faults)
    return replace(config, migration=replace(config.migration, **migration)) if migration else config


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secure"])
async def test_destination_out_of_blocks_aborts_at_pre_allocate(
    request: pytest.FixtureRequest, nats_url: str, secure: bool
) -> None:
    secure_nats = request.getfixturevalue("secure_nats") if secure else None
    async with agent_cluster(nats_url, secure_nats) as cluster:
        a1 = await cluster.add(sim_engine(time_scale=3.0), fast_agent_config("a1"))
        a2 = await cluster.add(sim_engine(num_blocks=6, time_scale=3.0), fast_agent_config("a2"))
        watcher = await _start(cluster)
        outcome = await a1.migrate("r1", "a2")
        assert not outcome.migrated and outcome.reason is MigrationAbortReason.OUT_OF_BLOCKS
        assert a2.engine.stats().num_free_blocks == 6 and a2.engine.stats().num_reserved_blocks == 0
        await _finished_once(watcher)
        assert {d.instance_id for d in watcher.deltas} == {"a1"}
        await _settle(a1, a2)
        assert a1.engine.stats().num_free_blocks == 64


async def test_lost_abort_at_pre_allocate_times_out_on_the_source(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(sim_engine(time_scale=3.0), fast_agent_config("a1"))
        a2 = await cluster.add(
            sim_engine(num_blocks=6, time_scale=3.0),
            _config("a2", FaultPlan(drop_outgoing=frozenset({"Abort"}))),
        )
        watcher = await _start(cluster)
        outcome = await a1.migrate("r1", "a2")
        assert not outcome.migrated and outcome.reason is MigrationAbortReason.ACK_TIMEOUT
        await _finished_once(watcher)
        await _settle(a1, a2)
        assert a1.engine.stats().num_free_blocks == 64 and a2.engine.stats().num_free_blocks == 6


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secure"])
async def test_request_finishing_mid_migration_rolls_back(
    request: pytest.FixtureRequest, nats_url: str, secure: bool
) -> None:
    secure_nats = request.getfixturevalue("secure_nats") if secure else None
    async with agent_cluster(nats_url, secure_nats) as cluster:
        a1 = await cluster.add(sim_engine(time_scale=1.0), _config("a1", FaultPlan(copy_delay_s=1.5)))
        a2 = await cluster.add(sim_engine(), fast_agent_config("a2"))
        watcher = await _start(cluster)
        migration = asyncio.ensure_future(a1.migrate("r1", "a2"))
        await asyncio.sleep(0.2)
        assert a2.engine.stats().num_reserved_blocks > 0  # stage 0 reserved, its copy is under way
        await _finished_once(watcher)
        outcome = await migration
        assert not outcome.migrated and outcome.reason is MigrationAbortReason.REQUEST_FINISHED
        await _settle(a1, a2)
        assert a1.engine.stats().num_free_blocks == 64 and a2.engine.stats().num_free_blocks == 64


async def test_request_preempted_mid_migration_rolls_back(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(
            sim_engine(num_blocks=40, time_scale=2.0), _config("a1", FaultPlan(copy_delay_s=1.0))
        )
        a2 = await cluster.add(sim_engine(), fast_agent_config("a2"))
        watcher = await cluster.watch("r1")
        low = GenerateRequest(request_id="r1", token_ids=PROMPT[:24], sampling=greedy(100), priority=5)
        assert (await cluster.generate("a1", low)).accepted
        await watcher.wait_tokens(4)
        migration = asyncio.ensure_future(a1.migrate("r1", "a2"))
        await asyncio.sleep(0.05)
        high = GenerateRequest(
            request_id="r2", token_ids=tuple(range(1, 101)), sampling=greedy(60), priority=0
        )
        assert (await cluster.generate("a1", high)).accepted
        outcome = await migration
        assert not outcome.migrated and outcome.reason is MigrationAbortReason.REQUEST_PREEMPTED
        assert a1.engine.stats().num_preemptions >= 1
        await watcher.wait_finished(timeout=10)
        tokens = watcher.tokens()  # no gap, no duplicate across the preemption and the rollback
        assert tokens == [sim_token_id("r1", None, i, 1000, 0) for i in range(100)]
        await watcher.close()
        await _settle(a1, a2)
        assert a1.engine.stats().num_free_blocks == 40 and a2.engine.stats().num_free_blocks == 64


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "secure"])
async def test_destination_killed_mid_transfer(
    request: pytest.FixtureRequest, nats_url: str, secure: bool
) -> None:
    secure_nats = request.getfixturevalue("secure_nats") if secure else None
    async with agent_cluster(nats_url, secure_nats) as cluster:
        a1 = await cluster.add(sim_engine(time_scale=3.0), _config("a1", FaultPlan(copy_delay_s=0.3)))
        a2 = await cluster.add(sim_engine(), fast_agent_config("a2"))
        watcher = await _start(cluster)
        migration = asyncio.ensure_future(a1.migrate("r1", "a2"))
        await asyncio.sleep(0.15)
        assert a2.engine.stats().num_reserved_blocks > 0
        await a2.kill()
        outcome = await migration
        assert not outcome.migrated and outcome.reason is MigrationAbortReason.COPY_FAILED
        await _finished_once(watcher)
        assert {d.instance_id for d in watcher.deltas} == {"a1"}
        await _settle(a1)
        assert a1.engine.stats().num_free_blocks == 64


async def test_source_killed_mid_transfer_releases_the_reservation(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(sim_engine(time_scale=3.0), _config("a1", FaultPlan(copy_delay_s=5.0)))
        a2 = await cluster.add(sim_engine(), _config("a2", destination_idle_timeout_s=0.6))
        watcher = await _start(cluster)
        migration = asyncio.ensure_future(a1.migrate("r1", "a2"))
        await asyncio.sleep(0.15)
        assert a2.engine.stats().num_reserved_blocks > 0
        await a1.kill()
        migration.cancel()
        await asyncio.sleep(1.0)
        assert a2.engine.stats().num_reserved_blocks == 0 and a2.engine.stats().num_free_blocks == 64
        assert not a2.engine.has_unfinished()  # the request was not duplicated onto the destination
        assert watcher.deltas and watcher.deltas[-1].finish_reason is None  # it died with its source
        assert {d.owner_epoch for d in watcher.deltas} == {0}
        await watcher.close()


#: (message type, the agent that sends it, fault, whether the migration still succeeds)
MESSAGE_FAULTS = [
    ("PreAllocate", "a1", "drop", False),
    ("PreAllocate", "a1", "duplicate", True),
    ("Ack", "a2", "drop", False),
    ("Ack", "a2", "duplicate", True),
    ("StageDone", "a1", "drop", True),
    ("StageDone", "a1", "duplicate", True),
    ("Commit", "a1", "drop", False),
    ("Commit", "a1", "duplicate", True),
    ("CommitAck", "a2", "drop", True),
    ("CommitAck", "a2", "duplicate", True),
]


@pytest.mark.parametrize(("message", "sender", "fault", "migrates"), MESSAGE_FAULTS)
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
async def test_lost_or_repeated_handshake_message(
    nats_url: str, message: str, sender: str, fault: str, migrates: bool, direction: str
) -> None:
    receiver = "a2" if sender == "a1" else "a1"
    field = f"{fault}_{direction}"
    faulty = sender if direction == "outgoing" else receiver
    plan = FaultPlan(**{field: frozenset({message})}, max_faults=1)
    async with agent_cluster(nats_url) as cluster:
        agents = {}
        for name in ("a1", "a2"):
            config = _config(name, plan if name == faulty else FaultPlan())
            agents[name] = await cluster.add(sim_engine(time_scale=2.5), config)
        a1, a2 = agents["a1"], agents["a2"]
        watcher = await _start(cluster)
        outcome = await a1.migrate("r1", "a2")
        assert agents[faulty].migration.faults_applied, "the fault was not injected"
        assert outcome.migrated is migrates, outcome.reason
        await _finished_once(watcher)
        epochs = watcher.epochs()
        assert epochs == sorted(epochs) and set(epochs) == ({0, 1} if migrates else {0})
        logged = await _outcomes_logged(cluster, outcome)
        if message in ("Commit", "CommitAck") and fault == "drop":
            assert len(logged) == 1 and isinstance(logged[0], CommitAck if migrates else Abort)
        await _settle(a1, a2)
        assert a1.engine.stats().num_free_blocks == 64 and a2.engine.stats().num_free_blocks == 64
        assert a1.engine.stats().num_reserved_blocks == 0 and a2.engine.stats().num_reserved_blocks == 0


def test_fault_plan_names_only_real_messages() -> None:
    with pytest.raises(ValueError, match="unknown migration message"):
        FaultPlan(drop_outgoing=frozenset({"Comit"}))
    assert MigrationConfig().max_concurrent_per_instance == 1
