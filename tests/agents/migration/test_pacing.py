"""Paced stage copies (``MigrationConfig.copy_step_share``): chunk sizes follow the step budget,
one chunk per engine step, never past the copy's time limit; and a paced live migration between
two torch agents on a real nats-server still yields exactly the tokens of an unmigrated run."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from agents.agent import Agent, FaultPlan, StepPace
from agents.engines.torch_engine import TorchEngine
from agents.migration.fsm.config import MigrationConfig, short_of_memory
from agents.migration.pacing import CopyPacer, StepClock
from schemas import GenerateRequest, SamplingParams
from schemas.reasons import MigrationAbortReason
from tests.agents.agent_cluster import (
    AgentCluster,
    TokenWatcher,
    agent_cluster,
    fast_agent_config,
    unmigrated_tokens,
)

SAMPLING = SamplingParams(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True)
PROMPT = tuple((i * 53) % 300 + 1 for i in range(150))  # 9 full blocks of 16 at the move


def _clock(step_s: float) -> StepClock:
    clock = StepClock()
    for _ in range(3):
        clock.step_done(step_s)
    return clock


async def test_a_chunk_waits_for_a_step_and_is_sized_to_the_step_budget() -> None:
    clock = _clock(0.2)
    pacer = CopyPacer(clock, share=0.5, total=100, time_limit_s=60.0)
    assert await pacer.next_chunk(0) == 1  # the first chunk measures what one unit costs
    await asyncio.sleep(0.01)  # its work: ~10 ms a unit
    waiting = asyncio.ensure_future(pacer.next_chunk(1))
    await asyncio.sleep(0.1)
    assert not waiting.done()  # no step has completed since the chunk ended
    clock.step_done(0.2)
    units = await asyncio.wait_for(waiting, 1.0)
    # the budget is share x step = 100 ms of work: about 10 units at ~10 ms each, never more
    assert 3 <= units <= 10
    assert (pacer.num_chunks, pacer.largest_chunk) == (2, units)


async def test_without_steps_the_duty_cycle_spaces_the_chunks() -> None:
    clock = _clock(0.01)
    pacer = CopyPacer(clock, share=0.25, total=10, time_limit_s=60.0)
    await pacer.next_chunk(0)
    await asyncio.sleep(0.02)
    started = time.perf_counter()
    await pacer.next_chunk(1)  # no step comes: the chunk waits work x (1 - s) / s = ~60 ms
    assert time.perf_counter() - started >= 0.05


async def test_chunks_space_out_while_the_steps_beside_them_run_slow() -> None:
    clock = _clock(0.1)  # the step before the copy: 100 ms
    pacer = CopyPacer(clock, share=0.5, total=100, time_limit_s=60.0)
    await pacer.next_chunk(0)
    await asyncio.sleep(0.005)
    waiting = asyncio.ensure_future(pacer.next_chunk(1))
    await asyncio.sleep(0.01)
    clock.step_done(0.3)  # 3x the step before the copy, more than 1 + share
    await waiting
    assert pacer.stretch > 1
    slowed = pacer.stretch
    await asyncio.sleep(0.005)
    waiting = asyncio.ensure_future(pacer.next_chunk(2))
    await asyncio.sleep(0.01)
    clock.step_done(0.1)  # back to normal: the spacing relaxes again
    await waiting
    assert pacer.stretch < slowed


async def test_a_copy_that_would_miss_its_time_limit_goes_at_full_speed() -> None:
    clock = _clock(0.2)
    pacer = CopyPacer(clock, share=0.1, total=50, time_limit_s=0.05)
    await pacer.next_chunk(0)
    await asyncio.sleep(0.01)  # 49 units at 10 ms, paced to 10%: ~5 s, far past 50 ms
    clock.step_done(0.2)
    assert await pacer.next_chunk(1) == 49
    assert pacer.unpaced


async def test_an_engine_that_never_stepped_is_not_paced() -> None:
    pacer = CopyPacer(StepClock(), share=0.1, total=40, time_limit_s=60.0)
    assert await pacer.next_chunk(0) == 40


async def test_an_engine_that_stopped_stepping_is_not_paced() -> None:
    clock = _clock(0.2)
    clock.last_step_at -= 5.0  # its last step ended 5 s ago: an idle destination, say
    pacer = CopyPacer(clock, share=0.1, total=40, time_limit_s=60.0)
    assert await pacer.next_chunk(0) == 40


async def test_a_hurried_pacer_ends_its_wait_and_sends_the_rest() -> None:
    clock = _clock(0.2)
    pacer = CopyPacer(clock, share=0.1, total=100, time_limit_s=60.0)
    assert await pacer.next_chunk(0) == 1
    await asyncio.sleep(0.01)
    waiting = asyncio.ensure_future(pacer.next_chunk(1))  # no step comes: it would wait ~90 ms and more
    await asyncio.sleep(0.02)
    assert not waiting.done()
    pacer.hurry()
    for _ in range(20):  # a few turns of the event loop, no timer: the wait ends at once
        if waiting.done():
            break
        await asyncio.sleep(0)
    assert waiting.done(), "hurry() did not end the wait for the next chunk's turn"
    assert waiting.result() == 99  # all that remains
    assert pacer.hurried and pacer.num_chunks == 2


async def test_a_pacer_asks_whether_it_is_urgent_before_each_chunk() -> None:
    urgent = False
    clock = _clock(0.2)
    pacer = CopyPacer(clock, share=0.5, total=100, time_limit_s=60.0, urgent=lambda: urgent)
    assert await pacer.next_chunk(0) == 1
    await asyncio.sleep(0.005)
    clock.step_done(0.2)
    assert await pacer.next_chunk(1) < 99 and not pacer.hurried
    urgent = True
    clock.step_done(0.2)
    assert await asyncio.wait_for(pacer.next_chunk(50), 1.0) == 50
    assert pacer.hurried


def test_a_source_short_of_memory_copies_at_full_speed() -> None:
    def short(terminating: bool = False, waiting: int = 0, free: int = 10, growth: int = 4) -> bool:
        return short_of_memory(
            terminating=terminating, num_waiting=waiting, num_free_blocks=free, expected_growth_blocks=growth
        )

    assert not short()
    assert short(terminating=True) and short(waiting=1) and short(growth=11)
    paced = MigrationConfig(copy_step_share=0.1)
    assert paced.for_source(short_of_memory=False) is paced
    assert paced.for_source(short_of_memory=True).copy_step_share == 0.0
    unpaced = MigrationConfig(copy_step_share=0.0)
    assert unpaced.for_source(short_of_memory=False) is unpaced


def test_the_share_is_validated() -> None:
    with pytest.raises(ValueError, match="copy_step_share"):
        MigrationConfig(copy_step_share=1.5)
    with pytest.raises(ValueError, match="share"):
        CopyPacer(StepClock(), share=0.0, total=1, time_limit_s=1.0)


def _engine() -> TorchEngine:
    return TorchEngine("tiny", num_blocks=64, batch_invariant=True)


def _reference_tokens() -> list[int]:
    return unmigrated_tokens(_engine(), PROMPT, SAMPLING, "moving")


async def _moving_beside_decoding(
    cluster: AgentCluster, shares: tuple[float, float], source_faults: FaultPlan, *, background_tokens: int
) -> tuple[Agent, Agent, TokenWatcher]:
    """Agents p1 (with ``source_faults``) and p2 pacing copies at ``shares``, a request decoding on
    each (``background_tokens`` long), and ``moving`` (9+ full blocks) on p1 with 5 tokens out."""
    agents = []
    for name, share in zip(("p1", "p2"), shares, strict=True):
        config = fast_agent_config(name, faults=source_faults if name == "p1" else FaultPlan())
        migration = replace(config.migration, copy_step_share=share, copy_timeout_s=20.0)
        agents.append(await cluster.add(_engine(), replace(config, migration=migration)))
    for instance, name in (("p1", "bg1"), ("p2", "bg2")):  # co-located requests on both sides
        sampling = SamplingParams(max_tokens=background_tokens, ignore_eos=True)
        background = GenerateRequest(request_id=name, token_ids=(3, 4, 5), sampling=sampling)
        assert (await cluster.generate(instance, background)).accepted
    watcher = await cluster.watch("moving")
    request = GenerateRequest(request_id="moving", token_ids=PROMPT, sampling=SAMPLING)
    assert (await cluster.generate("p1", request)).accepted
    await watcher.wait_tokens(5)
    return agents[0], agents[1], watcher


async def _move_beside_decoding(
    nats_url: str, shares: tuple[float, float], *, drain_source: bool = False
) -> tuple[object, dict[int, tuple[int, int]]]:
    """``moving`` (9+ full blocks) moved from p1 to p2 (``copy_step_share`` of each) while a request
    decodes on each side; returns the outcome and the destination's paced writes (stage -> chunks,
    largest), after checking the moved request's tokens are exactly an unmigrated run's."""
    expected = _reference_tokens()
    pace = StepPace(0.02)  # the source until the outcome: the 35 tokens left last >= 0.7 s
    async with agent_cluster(nats_url) as cluster:
        source, destination, watcher = await _moving_beside_decoding(
            cluster, shares, FaultPlan(pace=pace), background_tokens=150
        )
        if drain_source:
            await source.drain()
        outcome = await source.migrate("moving", "p2")
        pace.release()
        assert outcome.migrated, (outcome.reason, outcome.detail)
        assert outcome.stages[0].num_blocks >= 9
        written = destination.migration.finished_destinations[outcome.migration_id].write_chunks
        await watcher.wait_finished(timeout=30)
        assert watcher.tokens() == expected
        await watcher.close()
    return outcome, written


async def test_a_paced_migration_moves_the_request_exactly_in_chunks(nats_url: str) -> None:
    outcome, written = await _move_beside_decoding(nats_url, (0.5, 0.5))
    first = outcome.stages[0]  # type: ignore[attr-defined]
    # the first stage went in several chunks, none of them the whole stage; the last at once
    assert 2 <= first.num_chunks <= first.num_blocks
    assert first.largest_chunk_blocks < first.num_blocks
    assert outcome.stages[-1].num_chunks == 1  # type: ignore[attr-defined]
    assert written[0][0] >= 2 and written[0][1] < first.num_blocks  # written paced too


async def test_the_destination_writes_at_the_pace_the_source_sends(nats_url: str) -> None:
    """The share travels in PreAllocate: a destination that would not pace follows a pacing source."""
    outcome, written = await _move_beside_decoding(nats_url, (0.5, 0.0))
    first = outcome.stages[0]  # type: ignore[attr-defined]
    assert first.num_chunks >= 2
    assert written[0][0] >= 2 and written[0][1] < first.num_blocks


async def test_a_draining_agent_moves_its_requests_at_full_speed(nats_url: str) -> None:
    """An instance that is leaving does not pace: its copies and the destination's writes go whole."""
    outcome, written = await _move_beside_decoding(nats_url, (0.5, 0.5), drain_source=True)
    assert all(stage.num_chunks == 1 for stage in outcome.stages)  # type: ignore[attr-defined]
    assert not written


async def _move_hurried(nats_url: str, reason: str) -> None:
    """``moving`` is migrated from p1 to p2 with pacing on both (share 0.5) while its copy waits
    at a gate; meanwhile the migration is made to hurry (``reason``): every stage then goes in one
    chunk, the destination hears of it, the source's metric counts it, and the tokens are exactly
    an unmigrated run's."""
    expected = _reference_tokens()
    gate = asyncio.Event()
    async with agent_cluster(nats_url) as cluster:
        source, destination, watcher = await _moving_beside_decoding(
            cluster, (0.5, 0.5), FaultPlan(copy_gate=gate), background_tokens=400
        )
        moving = asyncio.ensure_future(source.migrate("moving", "p2"))
        while not destination.migration.destinations:  # stage 0 reserved; its copy waits at the gate
            await asyncio.sleep(0.01)
        (incoming,) = destination.migration.destinations.values()
        assert incoming.paced
        if reason == "slot_wanted":  # a second migration out of p1 finds the slot taken
            refused = await source.migrate("bg1", "p2")
            assert refused.reason is MigrationAbortReason.TOO_MANY_OUTGOING
        else:  # p1 turns short of memory while the migration copies
            source.migration.short_of_memory = lambda: True  # type: ignore[method-assign]
        gate.set()
        outcome = await asyncio.wait_for(moving, 20)
        assert outcome.migrated, (outcome.reason, outcome.detail)
        assert outcome.hurried == reason
        assert all(stage.num_chunks == 1 for stage in outcome.stages)
        assert incoming.hurried == reason
        if reason == "slot_wanted":  # hurried before the data came: written at full speed
            assert not incoming.write_chunks
        # (short of memory: the source hurries at its first chunk and HurryCopy races the data;
        # a paced write that began is hurried mid-way: tests above)
        metrics = source.metrics.render().decode()
        assert f'shoal_agent_migrations_hurried_total{{reason="{reason}"}} 1.0' in metrics
        await watcher.wait_finished(timeout=30)
        assert watcher.tokens() == expected
        await watcher.close()


async def test_a_paced_migration_hurries_when_another_wants_its_slot(nats_url: str) -> None:
    await _move_hurried(nats_url, "slot_wanted")


async def test_a_paced_migration_hurries_when_its_source_runs_short_of_memory(nats_url: str) -> None:
    await _move_hurried(nats_url, "short_of_memory")
