"""Live migration deduplicated against the destination's prefix cache.

The source offers the chain hashes of the request's full blocks in its first
``PreAllocate``; the destination holds the leading run it caches and says how many in
its ``Ack``; only the other blocks travel. The pure machines first (the copy range, a bad
answer, an older peer, the rollback releasing the held blocks), then the engines'
accounting (a source's shared blocks, a destination's held ones), then two sim-engine
agents on a real nats-server (bytes on the transport, a request sharing blocks with the
migrating one, an aborted dedup migration leaking nothing).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.agent import Agent, FaultPlan
from agents.engines.block_manager import BlockManager
from agents.engines.sim import SimEngine, sim_token_id
from agents.migration.fsm.actions import (
    Action,
    AdmitRequest,
    CopyBlocks,
    CopyDone,
    OutcomeClaimed,
    ReleaseReservation,
    ReportFailed,
    Reserve,
    Reserved,
    SendToPeer,
)
from agents.migration.fsm.config import MigrationConfig
from agents.migration.fsm.destination import (
    DestinationPhase,
    DestinationState,
    destination_step,
    start_destination,
)
from agents.migration.fsm.source import SourcePhase, SourceState, source_step, start_source
from schemas import GenerateRequest
from schemas.block_hash import block_hashes
from schemas.migration import Abort, Ack, Commit, PreAllocate, StageDone
from schemas.reasons import MigrationAbortReason
from tests.agents.agent_cluster import AgentCluster, TokenWatcher, agent_cluster, fast_agent_config, greedy
from tests.agents.migration.test_fsm import apply_moves, faults, moves
from tests.agents.migration.world import CONFIG as WORLD_CONFIG
from tests.agents.migration.world import World

CONFIG = MigrationConfig(last_stage_max_blocks=2, max_stages=5)
HASHES = tuple(range(100, 120))  # a 20-block chain (the machines only count and pass them on)


# -- the machines ---------------------------------------------------------------------------


def _source(
    num_full_blocks: int = 20, hashes: tuple[int, ...] = HASHES
) -> tuple[SourceState, tuple[Action, ...]]:
    return start_source(
        migration_id="m",
        request_id="r",
        source_id="a",
        destination_id="b",
        num_full_blocks=num_full_blocks,
        now=0.0,
        config=CONFIG,
        block_hashes=hashes,
    )


def test_the_first_pre_allocate_offers_the_chain_and_the_ack_shortens_the_copy() -> None:
    state, actions = _source()
    (send,) = actions
    assert isinstance(send, SendToPeer) and isinstance(send.message, PreAllocate)
    assert send.message.block_hashes == HASHES and send.message.num_blocks == 20
    ack = Ack(migration_id="m", stage=0, block_ids=tuple(range(14)), num_cached_blocks=6)
    state, actions = source_step(state, ack, now=0.1, config=CONFIG)
    (copy,) = actions
    assert isinstance(copy, CopyBlocks)
    assert (copy.first_block, copy.end_block) == (6, 20)  # the 6 cached blocks stay home
    state, actions = source_step(state, CopyDone(stage=0, num_full_blocks=24), now=0.2, config=CONFIG)
    done, next_stage = actions
    assert isinstance(done, SendToPeer) and isinstance(done.message, StageDone)
    assert done.message.num_blocks == 14
    # later stages are as before, and offer nothing
    assert isinstance(next_stage, SendToPeer) and isinstance(next_stage.message, PreAllocate)
    assert next_stage.message.num_blocks == 4 and next_stage.message.block_hashes == ()
    assert state.num_cached_blocks == 6 and state.num_copied_blocks == 20


def test_an_ack_holding_every_block_of_a_stage_copies_an_empty_range() -> None:
    state, _ = _source(num_full_blocks=20)
    ack = Ack(migration_id="m", stage=0, block_ids=(), num_cached_blocks=20)
    state, actions = source_step(state, ack, now=0.1, config=CONFIG)
    (copy,) = actions
    assert isinstance(copy, CopyBlocks) and copy.first_block == copy.end_block == 20
    assert state.phase is SourcePhase.COPYING


def test_an_ack_holding_more_than_was_offered_is_a_bad_ack() -> None:
    state, _ = _source(hashes=HASHES[:5])
    ack = Ack(migration_id="m", stage=0, block_ids=tuple(range(14)), num_cached_blocks=6)
    state, actions = source_step(state, ack, now=0.1, config=CONFIG)
    assert state.phase is SourcePhase.ABORTED and state.reason is MigrationAbortReason.BAD_ACK
    assert any(isinstance(a, SendToPeer) and isinstance(a.message, Abort) for a in actions)


class _OldAck(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="mig_ack"):
    """An ``Ack`` as an agent from before deduplication declares it."""

    migration_id: str
    stage: int
    block_ids: tuple[int, ...]
    transfer_token: str = ""


class _OldPreAllocate(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="mig_pre_allocate"):
    migration_id: str
    request_id: str
    source_id: str
    destination_id: str
    stage: int
    num_blocks: int
    copy_step_share: float | None = None


def test_an_older_peer_on_either_side_gets_everything_copied() -> None:
    # an older destination: it reads the new PreAllocate (the hashes are ignored) and answers
    # without num_cached_blocks, so the source copies the whole stage
    state, (send,) = _source()
    assert isinstance(send, SendToPeer)
    old_view = msgspec.msgpack.decode(msgspec.msgpack.encode(send.message), type=_OldPreAllocate)
    assert old_view.num_blocks == 20
    old_ack = _OldAck(migration_id="m", stage=0, block_ids=tuple(range(20)))
    ack = msgspec.msgpack.decode(msgspec.msgpack.encode(old_ack), type=Ack)
    assert ack.num_cached_blocks == 0
    state, (copy,) = source_step(state, ack, now=0.1, config=CONFIG)
    assert isinstance(copy, CopyBlocks) and (copy.first_block, copy.end_block) == (0, 20)
    # an older source: its PreAllocate has no hashes, so the destination holds nothing
    old = _OldPreAllocate(
        migration_id="m", request_id="r", source_id="a", destination_id="b", stage=0, num_blocks=20
    )
    message = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=PreAllocate)
    _, (reserve,) = start_destination(message, destination_id="b", now=0.0, config=CONFIG)
    assert isinstance(reserve, Reserve) and reserve.block_hashes == () and reserve.num_blocks == 20


def _destination_holding(cached: tuple[int, ...], reserved: tuple[int, ...]) -> DestinationState:
    pre = PreAllocate(
        migration_id="m",
        request_id="r",
        source_id="a",
        destination_id="b",
        stage=0,
        num_blocks=len(cached) + len(reserved),
        block_hashes=HASHES[:8],
    )
    state, (reserve,) = start_destination(pre, destination_id="b", now=0.0, config=CONFIG)
    # the chain is cut to the stage's size
    assert isinstance(reserve, Reserve) and reserve.block_hashes == HASHES[: min(8, pre.num_blocks)]
    state, actions = destination_step(
        state, Reserved(stage=0, block_ids=reserved, cached_block_ids=cached), now=0.0, config=CONFIG
    )
    (send,) = actions
    assert isinstance(send, SendToPeer) and isinstance(send.message, Ack)
    assert send.message.num_cached_blocks == len(cached) and send.message.block_ids == reserved
    # a repeated PreAllocate gets the same answer
    _, (again,) = destination_step(state, pre, now=0.1, config=CONFIG)
    assert isinstance(again, SendToPeer) and again.message == send.message
    return state


def test_the_destination_releases_its_held_blocks_on_abort() -> None:
    state = _destination_holding(cached=(40, 41, 42), reserved=(7, 8, 9, 10, 11))
    abort = Abort(migration_id="m", reason=MigrationAbortReason.COPY_FAILED, sender_id="a")
    state, actions = destination_step(state, abort, now=0.2, config=CONFIG)
    release, report = actions
    assert isinstance(release, ReleaseReservation) and isinstance(report, ReportFailed)
    assert release.cached_block_ids == (40, 41, 42) and release.block_ids == (7, 8, 9, 10, 11)
    assert state.phase is DestinationPhase.ABORTED and state.cached_block_ids == ()


def test_the_destination_admits_with_the_held_blocks_first() -> None:
    state = _destination_holding(cached=(40, 41, 42), reserved=(7, 8))
    commit = Commit(
        migration_id="m",
        request_id="r",
        source_id="a",
        destination_id="b",
        token_ids=(1, 2, 3),
        num_prompt_tokens=2,
        owner_epoch=0,
        suspended_at=0.0,
    )
    state, _ = destination_step(state, commit, now=0.3, config=CONFIG)
    state, actions = destination_step(state, OutcomeClaimed(committed=True), now=0.4, config=CONFIG)
    admit = actions[0]
    assert isinstance(admit, AdmitRequest)
    assert admit.cached_block_ids == (40, 41, 42) and admit.block_ids == (7, 8)


# -- composed over a faulty channel ------------------------------------------------------------


@dataclass
class DedupWorld(World):
    """The toy world's destination caching the first ``cached`` blocks of the request's chain:
    it holds them at stage 0 (ids from 10 000) and must hand them to the admission or drop them."""

    cached: int = 0
    held: set[int] = field(default_factory=set)

    def start(self) -> None:
        self.src, actions = start_source(
            migration_id="m",
            request_id="r",
            source_id="a",
            destination_id="b",
            num_full_blocks=self.full_blocks,
            now=self.now,
            config=WORLD_CONFIG,
            block_hashes=tuple(range(self.full_blocks)),
        )
        self.run_src_actions(actions)

    def run_src_actions(self, actions: tuple[Action, ...]) -> None:
        assert self.src is not None
        for action in actions:
            if isinstance(action, CopyBlocks):
                self.check(action.first_block >= self.src.num_cached_blocks, "copied a block held cached")
        super().run_src_actions(actions)

    def run_dst_actions(self, actions: tuple[Action, ...]) -> None:
        for action in actions:
            if isinstance(action, Reserve) and action.block_hashes:
                self.check(not self.held, "held the cached prefix twice")
                hit = tuple(10_000 + i for i in range(min(self.cached, len(action.block_hashes))))
                self.held |= set(hit)
                ids = tuple(range(self.next_block, self.next_block + action.num_blocks - len(hit)))
                self.next_block += len(ids)
                self.reserved |= set(ids)
                self.to_destination(Reserved(stage=action.stage, block_ids=ids, cached_block_ids=hit))
            elif isinstance(action, ReleaseReservation | AdmitRequest):
                self.check(set(action.cached_block_ids) == self.held, "held blocks not all handed on")
                self.held.clear()
                super().run_dst_actions((action,))
            else:
                super().run_dst_actions((action,))

    def check_end(self) -> None:
        super().check_end()
        self.check(not self.held, f"cached blocks still held after both sides finished: {sorted(self.held)}")


@settings(max_examples=400, deadline=None)
@given(
    full_blocks=st.integers(1, 30),
    cached=st.integers(0, 40),
    moves=moves,
    reserve_fails=st.booleans(),
    faults=faults,
)
def test_a_dedup_migration_over_a_faulty_channel_holds_nothing_at_the_end(
    full_blocks: int, cached: int, moves: list[tuple[int, int]], reserve_fails: bool, faults: tuple[int, int]
) -> None:
    """Loss, duplication, reordering, delays, request endings and false failure suspicions, with
    the destination caching none, some or all of the request's full blocks: one owner (or none,
    it finished), no block copied that was held cached, nothing reserved or held at the end."""
    world = DedupWorld(
        full_blocks=full_blocks, cached=cached, reserve_fails=reserve_fails and cached % 3 == 0
    )
    world.start()
    apply_moves(world, moves, *faults)
    world.settle()
    world.check_end()


# -- the engines' accounting ------------------------------------------------------------------

PROMPT = tuple(range(1, 41))  # 10 full blocks of the sim's 4 tokens


def _run(engine: SimEngine, request_id: str, max_tokens: int) -> None:
    engine.add_request(request_id, PROMPT, greedy(max_tokens))
    while request_id in engine.scheduler:
        engine.step()


def test_a_source_releasing_a_migrated_request_keeps_the_blocks_another_shares() -> None:
    engine = SimEngine("tiny-test", num_blocks=64, prefix_cache=True)
    engine.add_request("first", PROMPT, greedy(30))
    engine.step()  # its prompt is computed and cached
    engine.add_request("moving", PROMPT, greedy(30))
    engine.step()
    first = engine.scheduler.request("first").block_ids
    moving = engine.scheduler.request("moving").block_ids
    blocks = engine.scheduler.blocks
    assert moving[:9] == first[:9] and all(blocks.ref_count(b) == 2 for b in first[:9])
    engine.release_request("moving")  # the migrated request leaves: one reference each
    assert all(blocks.ref_count(b) == 1 for b in first[:9])
    blocks.check_invariants()
    outputs = []
    while "first" in engine.scheduler:
        outputs += [o for o in engine.step().outputs if o.request_id == "first"]
    tokens = [t for o in outputs for t in o.token_ids]
    assert tokens == [sim_token_id("first", None, i, 1000, 0) for i in range(2, 30)]
    assert blocks.num_free_blocks == 64 and blocks.num_allocated_blocks == 0


def test_held_blocks_are_admitted_or_dropped_without_a_leak() -> None:
    engine = SimEngine("tiny-test", num_blocks=64, prefix_cache=True)
    _run(engine, "warm", 5)
    blocks: BlockManager = engine.scheduler.blocks
    chain = block_hashes((*PROMPT, 900, 901, 902, 903), 4)
    held = engine.hold_cached_blocks(chain)
    assert len(held) == 10 and blocks.num_allocated_blocks == 10  # taken off the LRU list
    engine.drop_held_blocks(held)
    assert blocks.num_allocated_blocks == 0 and blocks.num_cached_blocks >= 10
    blocks.check_invariants()
    # held, then admitted behind a reservation that received the rest
    held = engine.hold_cached_blocks(chain)
    reservation = engine.reserve(2)
    source = SimEngine("tiny-test", num_blocks=64)
    source.add_request("r", PROMPT, greedy(50), output_token_ids=(900, 901, 902, 903, 904))
    source.step()  # the rescued request recomputes, so its blocks hold all but its last token
    engine.import_blocks(reservation.block_ids, source.export_blocks("r", [10, 11]))
    engine.admit_migrated(
        "r",
        PROMPT,
        (900, 901, 902, 903, 904, *source.output_token_ids("r")[5:]),
        greedy(50),
        0,
        [reservation],
        cached_block_ids=held,
    )
    table = engine.scheduler.request("r").block_ids
    assert tuple(table[:10]) == held and all(blocks.ref_count(b) == 1 for b in held)
    engine.abort("r")
    assert blocks.num_allocated_blocks == 0 and blocks.num_reserved_blocks == 0
    blocks.check_invariants()


# -- two agents on a real nats-server ---------------------------------------------------------


def _engine() -> SimEngine:
    return SimEngine("tiny-test", num_blocks=96, time_scale=3.0, prefix_cache=True)


async def _watch_run(cluster: AgentCluster, instance: str, request_id: str, max_tokens: int) -> TokenWatcher:
    watcher = await cluster.watch(request_id)
    request = GenerateRequest(request_id=request_id, token_ids=PROMPT, sampling=greedy(max_tokens))
    assert (await cluster.generate(instance, request)).accepted
    return watcher


def _sim(agent: Agent) -> SimEngine:
    engine = agent.engine
    assert isinstance(engine, SimEngine)
    return engine


def _expected(request_id: str, count: int) -> list[int]:
    return [sim_token_id(request_id, None, i, 1000, 0) for i in range(count)]


async def _settle(*agents: Agent) -> None:
    async with asyncio.timeout(15):
        while any(a.engine.has_unfinished() or not a.migration.is_idle for a in agents):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)


async def test_only_the_blocks_the_destination_lacks_travel(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(_engine(), fast_agent_config("a1"))
        a2 = await cluster.add(_engine(), fast_agent_config("a2"))
        warm = await _watch_run(cluster, "a2", "warm", 4)  # a2 caches the prompt's 10 blocks
        await warm.wait_finished()
        sharer = await _watch_run(cluster, "a1", "sharer", 100)
        await sharer.wait_tokens(2)
        moving = await _watch_run(cluster, "a1", "moving", 120)  # shares sharer's prompt blocks on a1
        await moving.wait_tokens(12)
        blocks1 = _sim(a1).scheduler.blocks
        shared = _sim(a1).scheduler.request("moving").block_ids[:9]
        assert shared == _sim(a1).scheduler.request("sharer").block_ids[:9]
        assert all(blocks1.ref_count(b) == 2 for b in shared)
        sent_before = a1.transport.stats().bytes_sent
        outcome = await a1.migrate("moving", "a2")
        assert outcome.migrated, outcome.reason
        assert outcome.num_cached_blocks == 10
        copied = sum(stage.num_blocks for stage in outcome.stages)
        bytes_per_block = a1.engine.info.bytes_per_block
        assert outcome.bytes_saved == 10 * bytes_per_block
        assert sum(stage.num_bytes for stage in outcome.stages) == copied * bytes_per_block
        # the sim's buffers carry an 8-byte fingerprint per block: only the copied blocks went
        assert a1.transport.stats().bytes_sent - sent_before == 8 * copied
        blocks2 = _sim(a2).scheduler.blocks
        table = _sim(a2).scheduler.request("moving").block_ids
        assert [blocks2.block_hash(b) for b in table[:10]] == block_hashes(PROMPT, 4)  # a2's own
        await moving.wait_finished()
        await sharer.wait_finished()
        assert moving.tokens() == _expected("moving", 120)
        assert sharer.tokens() == _expected("sharer", 100)  # its shared blocks stayed on a1
        for watcher in (warm, sharer, moving):
            await watcher.close()
        await _settle(a1, a2)
        for agent in (a1, a2):
            blocks = _sim(agent).scheduler.blocks
            blocks.check_invariants()
            assert blocks.num_allocated_blocks == 0 and blocks.num_reserved_blocks == 0


async def test_an_aborted_dedup_migration_releases_the_held_blocks(nats_url: str) -> None:
    async with agent_cluster(nats_url) as cluster:
        # the Commit never reaches a2: a1 claims "aborted" and tells a2, which had held 10 blocks
        lost_commit = FaultPlan(drop_outgoing=frozenset({"Commit"}))
        a1 = await cluster.add(_engine(), fast_agent_config("a1", faults=lost_commit))
        a2 = await cluster.add(_engine(), fast_agent_config("a2"))
        warm = await _watch_run(cluster, "a2", "warm", 4)
        await warm.wait_finished()
        await _settle(a2)
        blocks2 = _sim(a2).scheduler.blocks
        cached_before = set(blocks2.cached_hashes())
        moving = await _watch_run(cluster, "a1", "moving", 120)
        await moving.wait_tokens(12)
        outcome = await a1.migrate("moving", "a2")
        assert not outcome.migrated and outcome.reason is MigrationAbortReason.COMMIT_TIMEOUT
        assert outcome.num_cached_blocks == 10
        await moving.wait_finished()
        assert moving.tokens() == _expected("moving", 120)  # it finished on the source
        await _settle(a1, a2)
        (record,) = [d.record for d in a2.migration.finished_destinations.values()]
        assert any(isinstance(t.input, Abort) for t in record.transitions)
        blocks2.check_invariants()
        assert blocks2.num_allocated_blocks == 0 and blocks2.num_reserved_blocks == 0
        assert blocks2.num_free_blocks == 96
        assert cached_before <= set(blocks2.cached_hashes())  # still cached, no longer held
        for watcher in (warm, moving):
            await watcher.close()
