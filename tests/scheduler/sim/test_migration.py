"""The simulator's migrations: their timing, a destination that leaves, and what a run reports about them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agents.engines.profile import load_profile
from agents.migration.fsm.actions import CopyDone
from agents.migration.fsm.config import MigrationConfig
from agents.migration.fsm.source import SourcePhase
from scheduler.config import PairingConfig
from scheduler.sim.config import MigrationModel, SimConfig, policy_setup
from scheduler.sim.instance import SimInstance
from scheduler.sim.simulator import Simulator, simulate
from scheduler.sim.workload import SimRequest, Workload
from schemas.reasons import MigrationAbortReason
from tests.scheduler.sim.overloaded import PaperRun

TINY = load_profile("tiny-test")  # 64 blocks of 4 tokens, 1 KiB each; steps of 1-3 ms


def _long_request_config(model: MigrationModel) -> SimConfig:
    """Two tiny instances paired back and forth while one long request decodes."""
    setup = policy_setup("llumnix-base", pairing=PairingConfig(low_freeness=60, high_freeness=63))
    return SimConfig(setup=setup, profile=TINY, num_instances=2, migration=model, record_migrations=True)


def _long_request(num_output_tokens: int = 150) -> Workload:
    request = SimRequest(request_id="long", arrival_s=0.0, num_prompt_tokens=40,
                         num_output_tokens=num_output_tokens, priority=0)
    return Workload(requests=(request,), description="one long request")


def test_downtime_is_the_last_stage_then_the_commit_message_and_the_claim() -> None:
    # suspend -> PreAllocate, Ack (one handshake), copy, StageWritten + Commit (another), claim
    model = MigrationModel(handshake_latency_s=0.010, commit_latency_s=0.020,
                           config=MigrationConfig(max_stages=2))
    sim = Simulator(_long_request_config(model), _long_request())
    result = sim.run()
    committed = [m for m in sim.migrations.finished if m.migrated]
    assert committed and result.migrations == len(committed)
    for migration in committed:
        last_copy_s = 8 * 1024 / model.bandwidth_bytes_per_s  # at most 8 tiny blocks: microseconds
        assert migration.downtime_s == pytest.approx(2 * 0.010 + 0.020, abs=last_copy_s)
    assert result.migration_downtime_mean_s == pytest.approx(0.040, abs=1e-5)
    assert sim.records["long"].num_migrations == len(committed)
    assert sim.records["long"].num_output_tokens == 150


def test_a_destination_that_leaves_fails_the_migration_and_the_request_finishes_at_its_source() -> None:
    class DestinationLeaves(Simulator):
        """Takes the destination out of the cluster while stage 0 is being copied."""

        def _on_step_end(self, instance: SimInstance) -> None:
            super()._on_step_end(instance)
            for migration in list(self.migrations.live.values()):
                state = migration.source_state
                if state is not None and state.phase is SourcePhase.COPYING:
                    self._leave(self.instances[migration.destination.instance_id])

    model = MigrationModel(handshake_latency_s=0.020, config=MigrationConfig(max_stages=4))
    sim = DestinationLeaves(_long_request_config(model), _long_request())
    result = sim.run()
    assert result.migrations == 0 and result.migrations_aborted == 1
    assert result.migration_abort_reasons == {MigrationAbortReason.PEER_FAILED: 1}
    (migration,) = sim.migrations.finished
    assert migration.source_record is not None
    assert migration.source_record.phases[-1] == "aborted"
    assert result.num_finished == 1 and sim.records["long"].num_output_tokens == 150
    assert sim.records["long"].num_migrations == 0
    survivor = sim.instances[migration.source.instance_id]
    assert survivor.num_migrating_out == 0 and survivor.num_free_blocks == TINY.num_blocks


def test_a_run_reports_started_aborted_reasons_and_bytes_copied(overloaded_paper_run: PaperRun) -> None:
    sim, result = overloaded_paper_run.sim, overloaded_paper_run.result
    assert result.migrations_started == result.migrations + result.migrations_aborted
    assert sum(result.migration_abort_reasons.values()) == result.migrations_aborted
    assert MigrationAbortReason.OUT_OF_BLOCKS in result.migration_abort_reasons
    copied = sum(
        t.input.num_bytes
        for m in sim.migrations.finished if m.source_record is not None
        for t in m.source_record.transitions if isinstance(t.input, CopyDone)
    )
    assert result.migration_bytes == copied > 0
    block = load_profile("llama-7b-a10").kv_bytes_per_block
    assert result.migration_bytes % block == 0
    for instance in sim.instances.values():
        assert instance.num_migrating_in == instance.num_migrating_out == instance.num_reserved_blocks == 0
    document = result.to_dict(series=False)
    for key in ("migrations_started", "migration_abort_reasons", "migration_bytes"):
        assert key in document


def test_shoal_pairs_only_destinations_with_room_and_moves_a_request_at_most_three_times(
    overloaded_paper_run: PaperRun,
) -> None:
    workload, config = overloaded_paper_run.workload, overloaded_paper_run.config
    no_room = {MigrationAbortReason.OUT_OF_BLOCKS, MigrationAbortReason.TOO_MANY_INCOMING}
    paper = overloaded_paper_run.result
    assert paper.migration_abort_reasons[MigrationAbortReason.OUT_OF_BLOCKS] > 10
    shoal = simulate(replace(config, setup=policy_setup("shoal")), workload)
    assert shoal.migrations > 0 and shoal.num_finished == len(workload.requests)
    assert not no_room & set(shoal.migration_abort_reasons)
    assert shoal.max_migrations_per_request <= 3 and shoal.churn == 0
    assert sum(shoal.migrations_per_request.values()) == len(workload.requests)
    assert sum(int(k) * n for k, n in shoal.migrations_per_request.items()) == shoal.migrations
    # the room check is what spares the destinations: the paper's rules with it alone
    room_checked = policy_setup("llumnix", pairing=PairingConfig(room_check=True, min_room_blocks=1))
    checked = simulate(replace(config, setup=room_checked), workload)
    assert checked.migrations > 0 and not no_room & set(checked.migration_abort_reasons)

    # one long request on two tiny instances, paired back and forth every 20 ms: the paper's
    # rules move it again and again, shoal's three times
    def moves(setup_name: str) -> int:
        band = PairingConfig(low_freeness=60, high_freeness=63)
        ping_pong = SimConfig(setup=policy_setup(setup_name, pairing=band), profile=TINY, num_instances=2,
                              pairing_interval_s=0.02, report_interval_s=0.02)
        sim = Simulator(ping_pong, _long_request())
        sim.run()
        assert sim.records["long"].num_output_tokens == 150
        return sim.records["long"].num_migrations

    assert moves("llumnix") > 10
    assert moves("shoal") == 3


def test_a_paced_stage_copy_takes_one_over_the_share_longer_and_the_downtime_does_not_change() -> None:
    # the agents pace every stage but the last to copy_step_share of a step: the model stretches them alike
    def run(share: float) -> tuple[list[float], list[float]]:
        model = MigrationModel(
            bandwidth_bytes_per_s=1e7,  # 1 KiB blocks: ~0.1 ms each
            handshake_latency_s=0.010,
            commit_latency_s=0.020,
            config=MigrationConfig(max_stages=2, copy_step_share=share, copy_timeout_s=60.0),
        )
        sim = Simulator(_long_request_config(model), _long_request())
        sim.run()
        committed = [m for m in sim.migrations.finished if m.migrated and m.source_record is not None]
        assert committed
        first = [
            next(t.input for t in m.source_record.transitions if isinstance(t.input, CopyDone))
            for m in committed
            if m.source_record is not None
        ]
        # a stage's copy ends with the destination's StageWritten message (message_s)
        per_byte = [(c.duration_s - model.message_s) / c.num_bytes for c in first]
        return per_byte, [m.downtime_s for m in committed]

    unpaced_s_per_byte, unpaced_downtime = run(0.0)
    paced_s_per_byte, paced_downtime = run(0.25)
    assert unpaced_s_per_byte == pytest.approx([1e-7] * len(unpaced_s_per_byte))
    assert paced_s_per_byte == pytest.approx([4e-7] * len(paced_s_per_byte))  # 1 / 0.25 times longer
    assert max(paced_downtime) == pytest.approx(max(unpaced_downtime), abs=0.01)


def test_a_draining_source_copies_at_full_speed_though_copies_are_paced() -> None:
    """As the agents: an instance that is leaving moves its requests unpaced."""

    class Drains(Simulator):
        """Marks the long request's instance terminating once it has decoded a few tokens."""

        def _on_pair(self, tick: int) -> None:
            for instance in self.instances.values():
                if "long" in instance.request_ids and self.now > 0.02:
                    instance.terminating = instance.dirty = True
            super()._on_pair(tick)

    model = MigrationModel(
        bandwidth_bytes_per_s=1e7,
        handshake_latency_s=0.010,
        config=MigrationConfig(max_stages=2, copy_step_share=0.25, copy_timeout_s=60.0),
    )
    sim = Drains(_long_request_config(model), _long_request())
    sim.run()
    committed = [m for m in sim.migrations.finished if m.migrated and m.source_record is not None]
    assert committed and all(m.config.copy_step_share == 0.0 for m in committed)
    first = [
        next(t.input for t in m.source_record.transitions if isinstance(t.input, CopyDone))
        for m in committed
        if m.source_record is not None
    ]
    per_byte = [(c.duration_s - model.message_s) / c.num_bytes for c in first]
    assert per_byte == pytest.approx([1e-7] * len(first))


def test_a_paced_copy_hurries_once_its_source_runs_short_of_memory() -> None:
    """As the agents' pacers ask before every chunk: a source that turns short of memory (here: it
    starts draining) while a stage copies paced sends the rest of the stage at full speed."""

    class DrainsMidCopy(Simulator):
        def _on_step_end(self, instance: SimInstance) -> None:
            for m in self.migrations.live.values():
                if m.paced is not None and self.now - m.paced[1] > 0.02 and m.source is instance:
                    instance.terminating = instance.dirty = True
            super()._on_step_end(instance)

    share = 0.01  # a first stage of ~28 KiB: 2.9 ms at 1e7 B/s, paced ~0.29 s
    model = MigrationModel(
        bandwidth_bytes_per_s=1e7,
        handshake_latency_s=0.010,
        config=MigrationConfig(max_stages=2, copy_step_share=share, copy_timeout_s=60.0),
    )
    sim = DrainsMidCopy(_long_request_config(model), _long_request(200))
    result = sim.run()
    assert result.paced_copies >= 1 and result.hurried_copies == 1
    (hurried,) = [m for m in sim.migrations.finished if m.hurried]
    assert hurried.migrated and hurried.source_record is not None
    first = next(t.input for t in hurried.source_record.transitions if isinstance(t.input, CopyDone))
    paced_s = first.num_bytes / model.bandwidth_bytes_per_s / share
    assert 0.02 < first.duration_s < 0.5 * paced_s  # hurried after ~20 ms, not ~paced_s later
    assert sim.records["long"].num_output_tokens == 200
