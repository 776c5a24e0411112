"""``shoal bench recovery``: scheduler start to first successful dispatch, by log size.

For each log size (default 100k and 1M events) it writes a synthetic log
shaped like a busy cluster into a fresh prefix on an embedded nats-server: 64
instances join, then every dispatch is a ``Dispatched`` fold point (as the
live scheduler records them) followed by request lifecycle events, with a
load report per instance every few dispatches. Then it starts a scheduler and
times from ``run()`` to the first ``DispatchRequest`` answered with an
instance, twice: without a snapshot (the whole log is folded) and with one
(taken by a scheduler that ran over the log and stopped cleanly; the tail is
empty). Rows: ``events``, ``snapshot``, ``recovery_s`` (plus the snapshot's
size). Target: <= 1 s at 1M events with a snapshot.

Then (``--busy-seconds``, :mod:`scheduler.bench_retention`) the cost of long
retention: the bytes every stream stores per busy instance-hour, and the
recovery time over that log (a scheduler that ran over it and left a
snapshot, then a new one timed to its first dispatch; it resumes archiving
in the background).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from bus import BusConfig, JetStreamBus, event_loop
from bus.bench_progress import BenchProgress
from bus.errors import BusError
from bus.options import nats_option
from bus.protocol import StreamConfig
from bus.server import EmbeddedNats
from scheduler.bench_retention import finished_request, measure_retention
from scheduler.lease import LEASE_KEY
from scheduler.service import SchedulerConfig, SchedulerService
from schemas import Codec, Subjects
from schemas.decisions import Dispatched, LoadPosition, SchedulerTick
from schemas.instance import InstanceJoined, KVLayout, ModelIdentity
from schemas.load import LoadReport, PriorityLoad
from schemas.requests import RequestArrived
from schemas.rpc import DispatchReply, DispatchRequest

__all__ = ["bench_recovery", "measure_recovery", "write_synthetic_log"]

NUM_INSTANCES = 64
#: Events appended after the snapshot for the "snapshot + tail" case (the default snapshot cadence).
TAIL_EVENTS = 20_000


async def write_synthetic_log(bus: JetStreamBus, num_events: int, *, epoch: int = 1) -> None:
    """Append about ``num_events`` events (plus load reports) shaped like a busy cluster's log.

    Appends to what the streams hold already (fold points continue from their
    last sequences), as the scheduler of lease ``epoch``.
    """
    subjects = bus.config.subjects
    codec = Codec(producer="bench")
    now = time.time()
    layout = KVLayout(num_layers=32, num_kv_heads=32, head_dim=128, block_size=16, dtype="float16")
    ids = [f"inst-{k:03d}" for k in range(NUM_INSTANCES)]
    events_seq = start_events = await bus.last_seq(subjects.events_stream)
    loads_seq = await bus.last_seq(subjects.loads_stream)
    report_seq = dict.fromkeys(ids, loads_seq)
    accepted = dict.fromkeys(ids, 0)
    async with bus.appender(max_in_flight=4096) as pipe:

        async def event(subject: str, body: Any) -> None:
            nonlocal events_seq
            events_seq += 1
            await pipe.append(subject, codec.encode(body, time=now))

        async def report(instance_id: str) -> None:
            nonlocal loads_seq
            loads_seq += 1
            report_seq[instance_id] += 1
            body = LoadReport(
                instance_id=instance_id,
                seq=report_seq[instance_id],
                num_total_blocks=851,
                num_free_blocks=700,
                num_reserved_blocks=0,
                running=(PriorityLoad(priority=0, num_running=8, num_blocks=151),),
                head_of_line_demand=0,
                num_waiting=0,
                batch_size=8,
                freeness=87.0,
                virtual_usage=151.0,
                num_accepted=accepted[instance_id],
            )
            await pipe.append(subjects.load(instance_id), codec.encode(body, time=now))

        await event(subjects.sched("tick"), SchedulerTick(epoch=epoch, takeover=True))
        for instance_id in ids:
            await event(
                subjects.instance(instance_id),
                InstanceJoined(
                    instance_id=instance_id,
                    num_blocks=851,
                    block_size=16,
                    model=ModelIdentity(model_id="m"),
                    kv_layout=layout,
                    transport_address=f"tcp://{instance_id}",
                    engine="sim",
                ),
            )
        request = 0
        while events_seq - start_events < num_events:
            instance_id = ids[request % NUM_INSTANCES]
            request_id = f"req-{request}"
            await event(
                subjects.req(request_id),
                RequestArrived(request_id=request_id, num_prompt_tokens=128, max_tokens=32),
            )
            await event(
                subjects.sched("dispatch"),
                Dispatched(
                    epoch=epoch,
                    request_id=request_id,
                    instance_id=instance_id,
                    policy="freeness",
                    num_prompt_tokens=128,
                    loads=(LoadPosition(instance_id=instance_id, stream_seq=loads_seq),),
                    events_seq=events_seq,
                    loads_seq=loads_seq,
                ),
            )
            accepted[instance_id] += 1
            await event(
                subjects.req(request_id),
                finished_request(request_id),
            )
            if request % 4 == 0:
                await report(ids[(request // 4) % NUM_INSTANCES])
            request += 1


async def _first_dispatch(url: str, subjects: Subjects, config: SchedulerConfig) -> float:
    """Seconds from starting a scheduler to its first successful dispatch."""
    codec = Codec(producer="bench-client")
    async with (
        JetStreamBus(BusConfig(url=url, subjects=subjects, provision=False)) as client,
        JetStreamBus(_bus_config(url, subjects)) as bus,
    ):
        service = SchedulerService(bus, config)
        started = time.perf_counter()
        task = asyncio.create_task(service.run())
        request = codec.encode(DispatchRequest(request_id="probe", num_prompt_tokens=128), time=time.time())
        try:
            while True:
                try:
                    reply = await client.request(subjects.rpc_dispatch, request, timeout=0.2)
                    body = codec.decode(reply.data).body
                    if isinstance(body, DispatchReply) and body.instance_id is not None:
                        return time.perf_counter() - started
                except BusError:
                    pass
                if task.done():
                    task.result()
                await asyncio.sleep(0.005)
        finally:
            await service.stop()
            async with asyncio.timeout(30):
                await task


def _bus_config(url: str, subjects: Subjects) -> BusConfig:
    return BusConfig(url=url, subjects=subjects, streams=StreamConfig(loads_max_msgs_per_subject=1_000_000))


async def measure_recovery(
    url: str, num_events: int, progress: BenchProgress | None = None
) -> list[dict[str, Any]]:
    progress = progress or BenchProgress("recovery", 4)
    subjects = Subjects(f"bench{uuid.uuid4().hex[:8]}")
    progress.phase(f"writing a synthetic log of {num_events:,} events")
    async with JetStreamBus(_bus_config(url, subjects)) as bus:
        written = time.perf_counter()
        await write_synthetic_log(bus, num_events)
        written = time.perf_counter() - written
        total = await bus.last_seq(subjects.events_stream)
        loads = await bus.last_seq(subjects.loads_stream)
    fast: dict[str, Any] = dict(
        lease_ttl_s=2.0, pairing_interval_s=0.2, failure_timeout_s=3600.0, verify_shadow=False
    )
    rows = []
    progress.phase(f"recovery over {total:,} events without a snapshot")
    cold = await _first_dispatch(
        url, subjects, SchedulerConfig(use_snapshot=False, snapshot_every_s=0.05, **fast)
    )
    rows.append({"events": total, "loads": loads, "snapshot": False, "recovery_s": round(cold, 3)})
    async with JetStreamBus(_bus_config(url, subjects)) as bus:
        entry = await bus.kv_get("scheduler.snapshot")
        assert entry is not None, "the first run should have left a snapshot"
        lease = await bus.kv_get(LEASE_KEY)
        assert lease is not None
    progress.phase(f"recovery over {total:,} events from a snapshot")
    warm = await _first_dispatch(url, subjects, SchedulerConfig(use_snapshot=True, **fast))
    rows.append({"events": total, "loads": loads, "snapshot": True, "tail": 0, "recovery_s": round(warm, 3)})
    progress.phase(f"recovery from a snapshot with {TAIL_EVENTS:,} events after it")
    async with JetStreamBus(_bus_config(url, subjects)) as bus:  # a crash 20k events after the last snapshot
        await write_synthetic_log(bus, TAIL_EVENTS, epoch=4)
        tail_total = await bus.last_seq(subjects.events_stream)
        tail_loads = await bus.last_seq(subjects.loads_stream)
    tail = await _first_dispatch(url, subjects, SchedulerConfig(use_snapshot=True, **fast))
    rows.append(
        {
            "events": tail_total,
            "loads": tail_loads,
            "snapshot": True,
            "tail": tail_total - total,
            "recovery_s": round(tail, 3),
            "log_write_s": round(written, 1),
        }
    )
    return rows


@click.command("recovery")
@click.option(
    "--events",
    "sizes",
    multiple=True,
    type=int,
    default=(100_000, 1_000_000),
    show_default=True,
    help="Log sizes to test (repeat the option).",
)
@click.option(
    "--busy-seconds",
    type=int,
    default=120,
    show_default=True,
    help="Seconds of a busy 64-instance cluster to write for the retention cost (0: skip).",
)
@click.option("--rate", type=int, default=128, show_default=True, help="Requests a second in that log.")
@nats_option(None, help="Use this NATS server instead of an embedded one.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_recovery(
    sizes: tuple[int, ...], busy_seconds: int, rate: int, nats_url: str | None, json_path: Path | None
) -> None:
    """Scheduler recovery time (start to first dispatch) with and without a snapshot, and the
    storage per busy instance-hour of every stream with long retention.

    The defaults take a few minutes on two cores, most of it writing and folding the log of a
    million events; --events 100000 --busy-seconds 0 is a quick look.
    """
    retention: dict[str, Any] = {}

    async def run(url: str) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        progress = BenchProgress("recovery", 4 * len(sizes) + 2 * (busy_seconds > 0))
        for size in sizes:
            rows += await measure_recovery(url, size, progress)
        if busy_seconds > 0:
            progress.phase(f"writing {busy_seconds} s of a busy cluster's log at {rate} req/s")
            retention.update(await measure_retention(url, busy_seconds, rate))
            progress.phase("recovery over that log from a snapshot")
            subjects = retention.pop("subjects")
            fast: dict[str, Any] = dict(
                lease_ttl_s=2.0, pairing_interval_s=0.2, failure_timeout_s=3600.0, verify_shadow=False
            )
            await _first_dispatch(
                url, subjects, SchedulerConfig(use_snapshot=False, snapshot_every_s=0.05, **fast)
            )
            retention["recovery_s"] = round(
                await _first_dispatch(url, subjects, SchedulerConfig(use_snapshot=True, **fast)), 3
            )
        return rows

    if nats_url is None:
        with tempfile.TemporaryDirectory() as store, EmbeddedNats(store_dir=Path(store)) as server:
            rows = event_loop.run(run(server.url))
    else:
        rows = event_loop.run(run(nats_url))
    table = Table(title="scheduler recovery: start to first dispatch")
    for column in ("events", "load reports", "snapshot", "recovery s"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            str(row["events"]),
            str(row["loads"]),
            f"yes, tail {row['tail']}" if row["snapshot"] else "no",
            f"{row['recovery_s']:.3f}",
        )
    console = Console()
    console.print(table)
    if retention:
        _print_retention(console, retention)
    if json_path is not None:
        report = {"recovery": rows, "retention": retention or None, "loadavg": list(os.getloadavg())}
        json_path.write_text(json.dumps(report, indent=2))


def _print_retention(console: Console, retention: dict[str, Any]) -> None:
    table = Table(
        title=f"storage per busy instance-hour: {retention['instances']} instances, "
        f"{retention['busy_s']} s, {retention['rate']} req/s, "
        f"{retention['reports_per_instance_s']} load reports/s per instance"
    )
    for column in ("stream", "messages", "bytes", "MB per instance-hour"):
        table.add_column(column)
    for name, row in retention["streams"].items():
        per_hour = row["mb_per_instance_hour"]
        table.add_row(
            name,
            str(row["messages"]),
            str(row["bytes"]),
            f"{per_hour:.3f}"
            if per_hour is not None
            else f"bounded: {row['bounded_mb_per_instance']} MB/instance",
        )
    console.print(table)
    console.print(
        f"recovery over that log (snapshot, then start to first dispatch): {retention['recovery_s']:.3f} s"
    )
