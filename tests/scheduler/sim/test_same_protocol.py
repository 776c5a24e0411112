"""One migration protocol: the simulator and the live agents drive the same state machines.

Both shells record every transition of their machines (input, phases, actions;
:mod:`agents.migration.fsm.record`). Re-fed to fresh machines of
:mod:`agents.migration.fsm`, the recorded inputs give back exactly the
recorded transitions, for every migration of a simulated run (committed and
aborted) and for a migration between two live agents over a real
nats-server; and with the same stage budget a live migration and a simulated
one go through the same transitions in the same order. A shell that stopped
driving the shared machines (its own stage rule, its own abort logic) would
record transitions the machines do not make, or none.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from agents.engines.profile import load_profile
from agents.migration.fsm.actions import CopyDone
from agents.migration.fsm.config import MigrationConfig
from agents.migration.fsm.record import MachineRecord, SourceStart, replay
from agents.migration.source import SourceDriver
from scheduler.config import PairingConfig
from scheduler.sim.config import MigrationModel, SimConfig, policy_setup
from scheduler.sim.migration_shell import SimMigration
from scheduler.sim.simulator import Simulator
from scheduler.sim.workload import SimRequest, Workload
from schemas import GenerateRequest
from tests.agents.agent_cluster import agent_cluster, fast_agent_config, greedy, sim_engine
from tests.scheduler.sim.overloaded import PaperRun

#: Two stages: stage 0 while the request decodes, then the last one, suspended.
TWO_STAGES = MigrationConfig(
    max_stages=2, ack_timeout_s=5.0, copy_timeout_s=10.0, suspend_timeout_s=5.0, commit_timeout_s=5.0,
    claim_retry_s=1.0, destination_idle_timeout_s=30.0,
)


def _records(migration: SimMigration) -> list[MachineRecord]:
    return [r for r in (migration.source_record, migration.destination_record) if r is not None]


def _signatures(record: MachineRecord) -> list[tuple[str, str, str, tuple[str, ...]]]:
    return [t.signature for t in record.transitions]


def _ping_pong(config: MigrationConfig, handshake_s: float = 0.002) -> Simulator:
    """One long request on two tiny instances, paired back and forth while it decodes."""
    workload = Workload(
        requests=(SimRequest(request_id="long", arrival_s=0.0, num_prompt_tokens=40, num_output_tokens=150,
                             priority=0),),
        description="one long request",
    )
    setup = policy_setup("llumnix-base", pairing=PairingConfig(low_freeness=60, high_freeness=63))
    sim_config = SimConfig(
        setup=setup, profile=load_profile("tiny-test"), num_instances=2,
        migration=MigrationModel(handshake_latency_s=handshake_s, config=config), record_migrations=True,
    )
    simulator = Simulator(sim_config, workload)
    simulator.run()
    return simulator


def test_every_simulated_migration_replays_through_the_agents_machines(
    overloaded_paper_run: PaperRun,
) -> None:
    simulator, result = overloaded_paper_run.sim, overloaded_paper_run.result
    finished = simulator.migrations.finished
    assert result.migrations > 0 and result.migrations_aborted > 0
    assert len(finished) == result.migrations_started == result.migrations + result.migrations_aborted
    for migration in finished:
        source = migration.source_record
        assert source is not None
        assert source.transitions[-1].after == ("migrated" if migration.migrated else "aborted")
        for record in _records(migration):
            assert replay(record) == record.transitions, migration.migration_id
    multi_stage = [m for m in finished if m.migrated and m.num_stages >= 2]
    assert multi_stage, "no committed migration copied in stages"


async def test_a_live_migration_replays_and_matches_a_simulated_one(nats_url: str) -> None:
    simulated = _ping_pong(TWO_STAGES).migrations.finished[0]
    assert simulated.migrated and simulated.num_stages == 2
    async with agent_cluster(nats_url) as cluster:
        a1 = await cluster.add(sim_engine(time_scale=3.0), fast_agent_config("a1"))
        a2 = await cluster.add(sim_engine(time_scale=3.0), fast_agent_config("a2"))
        watcher = await cluster.watch("r1")
        reply = await cluster.generate(
            "a1", GenerateRequest(request_id="r1", token_ids=tuple(range(1, 41)), sampling=greedy(120))
        )
        assert reply.accepted
        await watcher.wait_tokens(20)
        driver = await a1.migration.begin("r1", "a2", config=TWO_STAGES)
        assert isinstance(driver, SourceDriver)
        try:
            outcome = await asyncio.wait_for(driver.done, 30.0)
        except TimeoutError:
            raise AssertionError("the live migration of r1 did not end within 30 s") from None
        assert outcome.migrated, outcome.reason
        await watcher.wait_finished()
        await watcher.close()
        destination = a2.migration.finished_destinations[outcome.migration_id]
        live = [driver.record, destination.record]

    for record in live:
        assert replay(record) == record.transitions
    assert [_signatures(r) for r in live] == [_signatures(r) for r in _records(simulated)]


@pytest.mark.parametrize("max_stages", [1, 3])
def test_simulated_stages_follow_the_machines_cut_off(max_stages: int) -> None:
    """The stages a simulated migration copies are the ones the machines' rule gives for its block counts.

    The rule (``agents.migration.fsm.source``): start suspended if at most
    ``last_stage_max_blocks`` blocks are full or ``max_stages`` is 1; after a
    stage, suspend if it left at most ``last_stage_max_blocks`` new full blocks
    or if the next stage would be the last one allowed; after the suspend one
    last stage copies the rest.
    """
    config = replace(TWO_STAGES, max_stages=max_stages, last_stage_max_blocks=2)
    simulator = _ping_pong(config, handshake_s=0.02)  # a stage lasts long enough to fill several blocks
    committed = [m for m in simulator.migrations.finished if m.migrated]
    assert committed
    cut_off_mattered = False
    for migration in committed:
        record = migration.source_record
        assert record is not None and isinstance(record.start, SourceStart)
        full_after = [t.input.num_full_blocks for t in record.transitions
                      if isinstance(t.input, CopyDone) and t.after != "committing"]
        expected = 1
        if record.start.num_full_blocks > config.last_stage_max_blocks and max_stages > 1:
            copied = record.start.num_full_blocks
            for stage, full in enumerate(full_after):
                if full - copied <= config.last_stage_max_blocks or stage + 2 >= max_stages:
                    cut_off_mattered |= full - copied > config.last_stage_max_blocks
                    expected = stage + 2
                    break
                copied = full
        assert migration.num_stages == expected, (migration.migration_id, full_after)
        assert migration.num_stages <= max_stages
    if max_stages == 1:
        assert all(m.source_record and m.source_record.phases[0] == "suspending" for m in committed)
    else:
        assert cut_off_mattered, "no migration reached the stage cut-off"
