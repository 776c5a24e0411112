"""Moving a queued request (not its KV) between two torch-engine agents on a real nats-server.

The scheduler's ``MoveQueued`` runs the migration protocol with a stage of zero
blocks: the source holds the request out of its queue, reserves nothing at the
destination, commits, and the destination queues it and publishes with the next
owner epoch. The moved request must give exactly the greedy tokens of an
unmoved run, finish once and have one owner; one that starts running before it
is held stays where it is (``REQUEST_STARTED``); a lost or repeated handshake
message leaves exactly one owner; a malformed command is refused and counted.
The blocker runs on an engine paced to a slowest speed (``StepPace``), so it is
still running when each test acts however fast the engine is.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from agents.agent import Agent, FaultPlan, StepPace
from agents.engines.torch_engine import TorchEngine
from agents.migration.manager import MigrationOutcome
from schemas import (
    Abort,
    AbortRequest,
    CommandRejectReason,
    CommandReply,
    CommitAck,
    Drain,
    GenerateRequest,
    MigrationAbortReason,
    MigrationCause,
    MigrationStarted,
    MoveQueued,
    RpcError,
    RpcErrorCode,
)
from tests.agents.agent_cluster import (
    AgentCluster,
    TokenWatcher,
    agent_cluster,
    fast_agent_config,
    greedy,
    unmigrated_tokens,
)

PROMPT = tuple((i * 37) % 300 + 1 for i in range(40))
SAMPLING = greedy(24)
NUM_BLOCKS = 48
#: the blocker's slowest pace: it reaches the model's length no sooner than a few seconds in
PACE_S = 0.01


def _engine(max_batch_size: int = 256) -> TorchEngine:
    return TorchEngine("tiny", num_blocks=NUM_BLOCKS, batch_invariant=True, max_batch_size=max_batch_size)


@pytest.fixture(scope="module")
def expected() -> list[int]:
    return unmigrated_tokens(_engine(), PROMPT, SAMPLING, "moving")


async def _queue_behind_a_blocker(
    cluster: AgentCluster, faults: FaultPlan | None = None
) -> tuple[Agent, Agent, TokenWatcher]:
    """``q1`` runs one request at a time and is busy with ``blocker``; ``moving`` waits behind it.

    The blocker runs until the test aborts it (or reaches the model's length, paced).
    """
    faults = faults or FaultPlan()
    paced = replace(faults, pace=StepPace(PACE_S))
    q1 = await cluster.add(_engine(max_batch_size=1), fast_agent_config("q1", faults=paced))
    q2 = await cluster.add(_engine(), fast_agent_config("q2", faults=faults))
    blocker = GenerateRequest(request_id="blocker", token_ids=(3, 4, 5), sampling=greedy(100_000))
    assert (await cluster.generate("q1", blocker)).accepted
    watcher = await cluster.watch("moving")
    moving = GenerateRequest(request_id="moving", token_ids=PROMPT, sampling=SAMPLING)
    assert (await cluster.generate("q1", moving)).accepted
    return q1, q2, watcher


async def _outcome(agent: Agent, request_id: str = "moving") -> MigrationOutcome:
    async with asyncio.timeout(10):
        while True:
            done = [o for o in agent.migration.outcomes if o.request_id == request_id]
            if done and agent.migration.is_idle:
                return done[-1]
            await asyncio.sleep(0.01)


async def _finished_once(watcher: TokenWatcher, expected: list[int]) -> None:
    await watcher.wait_finished(timeout=20)
    await asyncio.sleep(0.1)  # a second owner would keep publishing
    assert watcher.tokens() == expected
    assert sum(1 for d in watcher.deltas if d.finish_reason is not None) == 1
    await watcher.close()


async def _idle(cluster: AgentCluster, *agents: Agent) -> None:
    await cluster.call("q1", "abort", AbortRequest(request_id="blocker"))
    async with asyncio.timeout(10):
        while any(a.engine.has_unfinished() or not a.migration.is_idle for a in agents):
            await asyncio.sleep(0.01)
    for agent in agents:
        stats = agent.engine.stats()
        assert stats.num_free_blocks == NUM_BLOCKS and stats.num_reserved_blocks == 0


async def test_a_queued_request_moves_without_kv_and_gives_the_unmoved_tokens(
    nats_url: str, expected: list[int]
) -> None:
    async with agent_cluster(nats_url) as cluster:
        q1, q2, watcher = await _queue_behind_a_blocker(cluster)
        await asyncio.sleep(0.2)
        report = q1.load_report()  # what the scheduler sees: the stalled head and the request to move
        assert report.requeue_candidate is not None and report.requeue_candidate.request_id == "moving"
        assert report.requeue_candidate.num_prompt_tokens == len(PROMPT)
        assert report.head_of_line_wait_s >= 0.15
        reply = await cluster.call(
            "q1", "move_queued", MoveQueued(epoch=1, request_id="moving", destination_id="q2")
        )
        assert isinstance(reply, CommandReply) and reply.accepted, reply
        outcome = await _outcome(q1)
        assert outcome.migrated, outcome.reason
        assert outcome.stages == []  # nothing copied
        await _finished_once(watcher, expected)
        assert set(watcher.epochs()) == {1}  # every delta from the new owner, the first an announcement
        assert {d.instance_id for d in watcher.deltas} == {"q2"}
        assert q1.engine.request_stats("moving") is None
        assert q1.load_report().requeue_candidate is None
        logged = [env.body for _, env in await cluster.stored(cluster.subjects.mig(outcome.migration_id))]
        started = [b for b in logged if isinstance(b, MigrationStarted)]
        assert len(started) == 1 and started[0].cause is MigrationCause.REQUEUE
        claimed = await cluster.stored(f"{cluster.subjects.mig(outcome.migration_id)}.outcome")
        assert [type(env.body) for _, env in claimed] == [CommitAck]
        assert q2.transport.stats().transfers_received == 0
        await _idle(cluster, q1, q2)


async def test_a_request_that_started_running_before_it_is_held_stays_where_it_is(
    nats_url: str, expected: list[int]
) -> None:
    # the scheduler's report said "queued"; by the time the command comes it runs: the move aborts
    async with agent_cluster(nats_url) as cluster:
        q1 = await cluster.add(_engine(), fast_agent_config("q1"))
        q2 = await cluster.add(_engine(), fast_agent_config("q2"))
        watcher = await cluster.watch("moving")
        moving = GenerateRequest(request_id="moving", token_ids=PROMPT, sampling=SAMPLING)
        assert (await cluster.generate("q1", moving)).accepted
        await watcher.wait_tokens(1)
        reply = await cluster.call(
            "q1", "move_queued", MoveQueued(epoch=1, request_id="moving", destination_id="q2")
        )
        if reply.accepted:  # started, then aborted when held (it could also have finished already)
            outcome = await _outcome(q1)
            assert not outcome.migrated
            assert outcome.reason is MigrationAbortReason.REQUEST_STARTED
            logged = [env.body for _, env in await cluster.stored(cluster.subjects.mig(outcome.migration_id))]
            aborts = [b.reason for b in logged if isinstance(b, Abort)]
            assert aborts == [MigrationAbortReason.REQUEST_STARTED]
        else:
            assert reply.reason is CommandRejectReason.UNKNOWN_REQUEST  # it had finished
        await _finished_once(watcher, expected)
        assert set(watcher.epochs()) == {0}
        assert not q2.migration.destinations and not q2.migration.finished_destinations
        async with asyncio.timeout(10):
            while q1.engine.has_unfinished():
                await asyncio.sleep(0.01)
        assert q1.engine.stats().num_free_blocks == NUM_BLOCKS


MESSAGE_FAULTS = [
    # (message, sender, fault, moves)
    ("PreAllocate", "q1", "drop", False),  # the source times out waiting for the Ack: it stays queued
    ("PreAllocate", "q1", "duplicate", True),
    ("Ack", "q2", "drop", False),
    ("Ack", "q2", "duplicate", True),
    ("Commit", "q1", "drop", False),  # the source claims "aborted" first
    ("Commit", "q1", "duplicate", True),
    ("CommitAck", "q2", "drop", True),  # the log holds the commit: the source lets go
    ("CommitAck", "q2", "duplicate", True),
]


@pytest.mark.parametrize(("message", "sender", "fault", "moves"), MESSAGE_FAULTS)
async def test_a_lost_or_repeated_handshake_message_leaves_one_owner(
    nats_url: str, expected: list[int], message: str, sender: str, fault: str, moves: bool
) -> None:
    plan = FaultPlan(**{f"{fault}_outgoing": frozenset({message})}, max_faults=1)  # type: ignore[arg-type]
    async with agent_cluster(nats_url) as cluster:
        q1, q2, watcher = await _queue_behind_a_blocker(cluster, plan)
        reply = await cluster.call(
            "q1", "move_queued", MoveQueued(epoch=1, request_id="moving", destination_id="q2")
        )
        assert reply.accepted, reply
        outcome = await _outcome(q1)
        faulty = q1 if sender == "q1" else q2
        assert faulty.migration.faults_applied, "the fault was not injected"
        assert outcome.migrated is moves, outcome.reason
        claimed = await cluster.stored(f"{cluster.subjects.mig(outcome.migration_id)}.outcome")
        if message in ("Commit", "CommitAck"):
            assert len(claimed) == 1 and isinstance(claimed[0][1].body, CommitAck if moves else Abort)
        # if it did not move it is back in q1's queue, in its place, and runs there once the blocker is
        # gone (the blocker may already have reached the model's length): every delta at epoch 0, below
        await cluster.call("q1", "abort", AbortRequest(request_id="blocker"))
        await _finished_once(watcher, expected)
        assert set(watcher.epochs()) == ({1} if moves else {0})
        async with asyncio.timeout(10):  # the destination's idle timeout frees a reservation of 0
            while any(a.engine.has_unfinished() or not a.migration.is_idle for a in (q1, q2)):
                await asyncio.sleep(0.01)
        for agent in (q1, q2):
            assert agent.engine.stats().num_free_blocks == NUM_BLOCKS
            assert agent.engine.stats().num_reserved_blocks == 0


async def test_a_malformed_move_command_is_refused_and_counted(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        q1 = await cluster.add(_engine(), fast_agent_config("q1"))
        await cluster.add(_engine(), fast_agent_config("q2"))
        subject = cluster.subjects.rpc_agent("q1", "move_queued")
        garbage = await cluster.bus.request(subject, b"\x00not msgpack", timeout=5.0)
        assert isinstance(reply := cluster.codec.decode(garbage.data).body, RpcError)
        assert reply.code is RpcErrorCode.BAD_REQUEST
        wrong = await cluster.call("q1", "move_queued", Drain(epoch=1))  # a well-formed other command
        assert isinstance(wrong, RpcError) and wrong.code is RpcErrorCode.BAD_REQUEST
        assert q1.num_malformed_commands == 2
        unknown = await cluster.call(
            "q1", "move_queued", MoveQueued(epoch=1, request_id="nobody", destination_id="q2")
        )
        assert isinstance(unknown, CommandReply) and not unknown.accepted
        assert unknown.reason is CommandRejectReason.UNKNOWN_REQUEST
        await q1.migration.log.flush()  # the refusal is in the log, with the reason
        refused = [env.body for _, env in await cluster.stored(f"{cluster.subjects.prefix}.ev.mig.>")]
        assert [type(b).__name__ for b in refused] == ["MigrationStarted", "Abort"]
        assert refused[1].reason is MigrationAbortReason.NOT_RUNNING
        stale = await cluster.call(
            "q1", "move_queued", MoveQueued(epoch=0, request_id="nobody", destination_id="q2")
        )
        assert stale.reason is CommandRejectReason.STALE_EPOCH
        assert not q1.stopped.is_set() and q1.migration.is_idle
