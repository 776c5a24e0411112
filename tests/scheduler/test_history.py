"""Long retention on a real nats-server: the loads stream keeps a few reports per instance, yet every
decision is recomputed from the log, because the active scheduler archived every report into the history
stream; a replay of a later window starts from a checkpoint and rebuilds the same state."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from click.testing import CliRunner

from bus import BusConfig, JetStreamBus
from bus.protocol import StreamConfig
from frontend.cli import cli
from scheduler.cluster_state import encode_snapshot
from scheduler.config import PairingConfig, PolicyConfig
from scheduler.history import pack_loads, read_history, unpack_loads
from scheduler.logfile import LogEntry, RecordedLog, load_log, read_bus_log, write_log
from scheduler.replay import ReplayOptions, replay_log
from scheduler.service import SchedulerConfig, SchedulerService
from schemas import Codec, Subjects
from schemas.decisions import Dispatched, Paired
from schemas.load import LoadReport, PriorityLoad
from tests.scheduler.service_helpers import FakeAgent, delete_streams, new_prefix, place

KEPT_PER_INSTANCE = 5


def _config(url: str, prefix: str, keep: int = KEPT_PER_INSTANCE) -> BusConfig:
    return BusConfig(
        url=url,
        subjects=Subjects(prefix),
        ack_timeout=0.5,
        append_timeout=5.0,
        heartbeat=0.5,
        streams=StreamConfig(duplicate_window=10.0, loads_max_msgs_per_subject=keep),
    )


@contextlib.asynccontextmanager
async def _bus(url: str, prefix: str, keep: int = KEPT_PER_INSTANCE) -> AsyncIterator[JetStreamBus]:
    bus = JetStreamBus(_config(url, prefix, keep))
    await bus.connect()
    try:
        yield bus
    finally:
        await bus.close()


def _report(seq: int) -> bytes:
    used = 100 + (seq * 7) % 250
    report = LoadReport(
        instance_id=f"i{seq % 3}",
        seq=seq // 3 + 1,
        num_total_blocks=400,
        num_free_blocks=400 - used,
        num_reserved_blocks=0,
        running=(PriorityLoad(priority=0, num_running=seq % 9, num_blocks=used),),
        head_of_line_demand=0,
        num_waiting=seq % 2,
        batch_size=seq % 9,
        freeness=(400 - used) / 3,
        virtual_usage=float(used),
        num_accepted=seq,
    )
    return Codec(producer="agent").encode(report, time=100.0 + seq / 10)


def test_an_archive_batch_round_trips_and_a_damaged_one_is_an_error() -> None:
    entries = [
        LogEntry(seq, 100.0 + seq / 10, f"p.load.i{seq % 3}", _report(seq), f"m{seq}")
        for seq in range(1, 200)
    ]
    batch = pack_loads(entries)
    assert (batch.first_seq, batch.last_seq, batch.num_entries) == (1, 199, 199)
    assert unpack_loads(batch) == entries
    assert len(batch.data) < sum(len(e.data) for e in entries) / 5  # reports compress well together
    damaged = type(batch)(first_seq=1, last_seq=199, num_entries=199, data=batch.data[:-7])
    with pytest.raises(ValueError, match=r"archive batch 1\.\.199 is corrupt"):
        unpack_loads(damaged)


async def test_decisions_older_than_the_loads_stream_are_recomputed_from_the_archive(
    nats_url: str, tmp_path: object
) -> None:
    prefix = new_prefix()
    policy = PolicyConfig(pairing=PairingConfig(low_freeness=35, high_freeness=70))
    try:
        async with _bus(nats_url, prefix) as agent_bus, _bus(nats_url, prefix) as sched_bus:
            agents = [
                FakeAgent(agent_bus, "i0", hog_blocks=390, report_interval=0.02),
                FakeAgent(agent_bus, "i1", report_interval=0.02),
                FakeAgent(agent_bus, "i2", report_interval=0.02),
            ]
            for agent in agents:
                await agent.start()
            service = SchedulerService(
                sched_bus,
                SchedulerConfig(
                    policy=policy,
                    lease_ttl_s=1.0,
                    pairing_interval_s=0.05,
                    failure_timeout_s=5.0,
                    snapshot_every_s=0.2,
                    archive_interval_s=0.1,
                    checkpoint_every_s=0.6,
                ),
            )
            task = asyncio.create_task(service.run())
            await service.wait_active(10)
            middle = 0.0
            for wave in range(12):
                await asyncio.gather(*(place(agent_bus, f"r{wave}-{k}") for k in range(8)))
                await asyncio.sleep(0.15)
                if wave == 6:
                    middle = time.time()
            for agent in agents:
                await agent.stop()
            await asyncio.sleep(0.3)  # the scheduler reads the last reports, and archives them as it stops
            await service.stop()
            await asyncio.wait_for(task, 10)
            subjects = agent_bus.config.subjects
            last_load = await agent_bus.last_seq(subjects.loads_stream)
            log = await read_bus_log(agent_bus)
            raw = RecordedLog(
                prefix, log.events, [e for e in log.loads if e.seq > last_load - 3 * KEPT_PER_INSTANCE]
            )
        assert service.stats.checkpoints >= 2
        # the loads stream kept 5 reports per instance; the log read back has every one of them
        assert [e.seq for e in log.loads] == list(range(1, last_load + 1))
        assert last_load > 10 * KEPT_PER_INSTANCE * len(agents)

        full = replay_log(log, ReplayOptions(policy=policy))
        kinds = {row.kind for row in full.decisions}
        assert {"dispatch", "pairing"} <= kinds
        assert full.mismatches == [] and full.num_unverifiable == 0
        assert sum(isinstance(row.decision, Dispatched) for row in full.decisions) == 96
        assert any(isinstance(row.decision, Paired) for row in full.decisions)
        # without the archive, the same log cannot verify its decisions
        assert replay_log(raw, ReplayOptions(policy=policy)).num_unverifiable > 0

        # a window starts from the checkpoint before it: same decisions after it, same end state
        window = replay_log(log, ReplayOptions(from_time=middle))
        assert window.checkpoint is not None and window.checkpoint.events_seq > 0
        assert window.mismatches == [] and window.num_unverifiable == 0
        later = {row.seq for row in full.decisions if row.seq > window.checkpoint.events_seq}
        assert {row.seq for row in window.decisions} <= later and len(window.decisions) > 10
        assert encode_snapshot(window.state) == encode_snapshot(full.state)

        # the events stream lost its beginning: the replay starts from a checkpoint on its own
        assert window.checkpoint is not None
        cut = window.checkpoint.events_seq
        truncated = RecordedLog(
            prefix, [e for e in log.events if e.seq > cut], log.loads, checkpoints=log.checkpoints
        )
        alone = replay_log(truncated)
        assert alone.checkpoint is not None and alone.mismatches == [] and alone.num_unverifiable == 0
        assert encode_snapshot(alone.state) == encode_snapshot(full.state)

        # an exported file carries the checkpoints
        path = tmp_path / "cluster.log"  # type: ignore[operator]
        write_log(path, truncated)
        assert encode_snapshot(replay_log(load_log(path)).state) == encode_snapshot(full.state)
    finally:
        await delete_streams(nats_url, prefix)


async def test_a_corrupt_history_entry_is_named_and_skipped_only_when_asked(nats_url: str) -> None:
    prefix = new_prefix()
    codec = Codec(producer="test")
    try:
        async with _bus(nats_url, prefix) as bus:
            subjects = bus.config.subjects
            entries = [LogEntry(seq, 100.0 + seq, subjects.load("i0"), _report(seq)) for seq in (1, 2, 3)]
            good = pack_loads(entries)
            bad = type(good)(first_seq=4, last_seq=6, num_entries=3, data=b"not zlib at all")
            for batch in (good, bad):
                await bus.append(subjects.history("loads"), codec.encode(batch, time=time.time()))
        runner = CliRunner()
        args = ["replay", "--nats", nats_url, "--prefix", prefix, "--json"]
        failed = await asyncio.to_thread(runner.invoke, cli, args)
        assert failed.exit_code == 1
        assert f"history stream {subjects.history_stream} seq 2" in failed.output
        assert "is corrupt" in failed.output and "--skip-corrupt" in failed.output
        skipped = await asyncio.to_thread(runner.invoke, cli, [*args, "--skip-corrupt"])
        assert skipped.exit_code == 0, skipped.output
        assert f"warning: skipped history stream {subjects.history_stream} seq 2" in skipped.output
        assert '"num_loads": 3' in skipped.output  # the good batch's reports are in the log
    finally:
        await delete_streams(nats_url, prefix)


async def test_a_scheduler_taking_over_after_a_crash_archives_what_the_crashed_one_had_not(
    nats_url: str,
) -> None:
    prefix = new_prefix()
    config = SchedulerConfig(
        lease_ttl_s=1.0, pairing_interval_s=0.05, failure_timeout_s=30.0, snapshot_every_s=0.2,
        archive_interval_s=0.1,
    )  # fmt: skip
    try:
        async with _bus(nats_url, prefix, keep=100_000) as agent_bus:
            agent = FakeAgent(agent_bus, "i0", report_interval=0.02)
            await agent.start()
            async with _bus(nats_url, prefix, keep=100_000) as first_bus:
                first = SchedulerService(first_bus, config)
                task = asyncio.create_task(first.run())
                await first.wait_active(10)
                await asyncio.sleep(0.5)
                first.crash()  # kill -9: what it had read since its last flush is not archived
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait_for(task, 10)
            archived_by_first = first.archiver.archived_through
            await asyncio.sleep(0.5)  # reports go on while no scheduler runs
            async with _bus(nats_url, prefix, keep=100_000) as second_bus:
                second = SchedulerService(second_bus, config)
                task = asyncio.create_task(second.run())
                await second.wait_active(10)
                await asyncio.sleep(0.5)
                await agent.stop()
                await asyncio.sleep(0.3)  # the scheduler reads the agent's last reports
                await second.stop()  # and archives them on its way out
                await asyncio.wait_for(task, 10)
            last_load = await agent_bus.last_seq(agent_bus.config.subjects.loads_stream)
            archived, _ = await read_history(agent_bus)
        assert 0 < archived_by_first < last_load
        # the archive alone (no raw loads stream) holds every report, with no gap at the crash
        assert [entry.seq for entry in archived] == list(range(1, last_load + 1))
    finally:
        await delete_streams(nats_url, prefix)
