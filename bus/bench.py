"""``shoal bench bus``: append and replay throughput of the bus next to raw nats-py.

Measures, on one server with the same payloads, the same ``Nats-Msg-Id``
headers and the same number of appends in flight:

* acknowledged appends/s through ``bus.appender()`` vs nats-py's
  ``JetStreamContext.publish_async`` (futures resolved by acks);
* replayed messages/s through ``bus.replay()`` vs nats-py's ordered push
  consumer with a callback (its fastest consumption path).

Each measurement writes a fresh stream (a fresh prefix), so both sides read
the same number of messages. Repeats alternate which side goes first and the
table reports medians. Starts an embedded ``nats-server`` unless ``--nats``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import click
import nats
from nats.js import api
from rich.console import Console
from rich.table import Table

import schemas
from bus import event_loop
from bus.bench_progress import BenchProgress
from bus.jetstream import JetStreamBus
from bus.options import nats_option
from bus.protocol import BusConfig, StreamConfig
from bus.server import EmbeddedNats
from schemas.subjects import Subjects

__all__ = ["bench_bus", "run_bench"]

_NUM_SUBJECTS = 64


def load_report_payload() -> bytes:
    """A realistic encoded ``LoadReport`` envelope (what agents append most often)."""
    codec = schemas.Codec("agent-instance-0007")
    report = schemas.LoadReport(
        instance_id="instance-0007",
        seq=123_456,
        num_total_blocks=8192,
        num_free_blocks=3100,
        num_reserved_blocks=64,
        running=(
            schemas.PriorityLoad(priority=0, num_running=37, num_blocks=4800),
            schemas.PriorityLoad(priority=1, num_running=3, num_blocks=228),
        ),
        head_of_line_demand=41,
        num_waiting=5,
        batch_size=40,
        freeness=75.25,
        virtual_usage=5092.5,
        num_accepted=99_123,
    )
    return codec.encode(report, time=1_700_000_000.0)


def _payload(size: int) -> bytes:
    real = load_report_payload()
    if size <= 0:
        return real
    return (real * (size // len(real) + 1))[:size]


async def _timed(work: Callable[[], Awaitable[int]]) -> float:
    start = time.perf_counter()
    count = await work()
    return count / (time.perf_counter() - start)


async def _one_round(url: str, tag: str, count: int, payload: bytes, in_flight: int) -> dict[str, float]:
    """One measurement of all four numbers on fresh streams."""
    bus_names, raw_names = Subjects(f"bench{tag}bus"), Subjects(f"bench{tag}raw")
    streams = StreamConfig(events_max_age=3600.0, loads_max_age=3600.0)
    bus = JetStreamBus(BusConfig(url=url, subjects=bus_names, streams=streams, name="bench-bus"))
    provisioner = JetStreamBus(BusConfig(url=url, subjects=raw_names, streams=streams, name="bench-setup"))
    await provisioner.connect()  # identical stream config for the raw side
    await provisioner.close()
    nc = await nats.connect(url, name="bench-raw")
    js = nc.jetstream(publish_async_max_pending=in_flight)
    ids = [f"{tag}-{i}" for i in range(count)]

    def subject(names: Subjects, i: int) -> str:
        return f"{names.prefix}.ev.bench.s{i % _NUM_SUBJECTS}"

    async def raw_append() -> int:
        futures = []
        for i in range(count):
            headers = {"Nats-Msg-Id": ids[i]}
            futures.append(await js.publish_async(subject(raw_names, i), payload, headers=headers))
        await asyncio.gather(*futures)
        return count

    async def bus_append() -> int:
        async with bus.appender(max_in_flight=in_flight) as pipe:
            for i in range(count):
                await pipe.append(subject(bus_names, i), payload, msg_id=ids[i])
        return count

    async def raw_replay() -> int:
        done = asyncio.Event()
        received = 0

        async def on_msg(msg: Any) -> None:
            nonlocal received
            received += 1
            if received >= count:
                done.set()

        sub = await js.subscribe(
            f"{raw_names.prefix}.ev.>", cb=on_msg, ordered_consumer=True, deliver_policy=api.DeliverPolicy.ALL
        )
        await done.wait()
        await sub.unsubscribe()
        return received

    async def bus_replay() -> int:
        received = 0
        async with bus.replay(bus_names.events_stream) as feed:
            async for _ in feed:
                received += 1
        return received

    try:
        await bus.connect()
        result: dict[str, float] = {}
        bus_first = int(tag) % 2 == 0
        for name, work in (
            [("append_eps", bus_append), ("raw_append_eps", raw_append)]
            if bus_first
            else [("raw_append_eps", raw_append), ("append_eps", bus_append)]
        ):
            result[name] = await _timed(work)
        for name, work in (
            [("replay_eps", bus_replay), ("raw_replay_eps", raw_replay)]
            if bus_first
            else [("raw_replay_eps", raw_replay), ("replay_eps", bus_replay)]
        ):
            result[name] = await _timed(work)
        jsm = nc.jsm()
        for names in (bus_names, raw_names):
            for stream in (names.events_stream, names.loads_stream, f"KV_{names.kv_bucket}"):
                await jsm.delete_stream(stream)
        return result
    finally:
        await bus.close()
        await nc.close()


async def run_bench(
    url: str, *, count: int, payload_bytes: int, in_flight: int, repeat: int
) -> dict[str, Any]:
    """Run ``repeat`` rounds and return medians, ratios, every round and the parameters."""
    payload = _payload(payload_bytes)
    progress = BenchProgress("bus", repeat)
    rounds = []
    for k in range(repeat):
        progress.phase(f"round {k + 1}/{repeat}: {count:,} appends and replays, bus and raw nats-py")
        rounds.append(await _one_round(url, str(k), count, payload, in_flight))
    medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    return {
        **medians,
        "append_ratio": medians["append_eps"] / medians["raw_append_eps"],
        "replay_ratio": medians["replay_eps"] / medians["raw_replay_eps"],
        "rounds": rounds,
        "parameters": {
            "count": count,
            "payload_bytes": len(payload),
            "in_flight": in_flight,
            "repeat": repeat,
            "storage": "file",
            "raw_append": "nats-py JetStreamContext.publish_async",
            "raw_replay": "nats-py ordered push consumer, callback",
        },
    }


def _table(result: dict[str, Any]) -> Table:
    params = result["parameters"]
    table = Table(
        title=f"bus throughput: {params['count']} msgs x {params['payload_bytes']} B, "
        f"{params['in_flight']} in flight, median of {params['repeat']}"
    )
    for column in ("", "bus (msgs/s)", "raw nats-py (msgs/s)", "bus / raw"):
        table.add_column(column, justify="right")
    table.add_row(
        "append (acked)",
        f"{result['append_eps']:,.0f}",
        f"{result['raw_append_eps']:,.0f}",
        f"{result['append_ratio']:.2f}",
    )
    table.add_row(
        "replay",
        f"{result['replay_eps']:,.0f}",
        f"{result['raw_replay_eps']:,.0f}",
        f"{result['replay_ratio']:.2f}",
    )
    return table


@click.command("bus")
@nats_option(None, help="Use this NATS server instead of an embedded one.")
@click.option("--count", default=50_000, show_default=True, help="Messages per measurement.")
@click.option(
    "--payload-bytes",
    default=0,
    show_default=True,
    help="Payload size; 0 uses a real encoded LoadReport envelope.",
)
@click.option("--in-flight", default=256, show_default=True, help="Unacknowledged appends allowed at once.")
@click.option(
    "--repeat", default=3, show_default=True, help="Rounds; medians are reported (more: e.g. --repeat 9)."
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_bus(
    nats_url: str | None, count: int, payload_bytes: int, in_flight: int, repeat: int, json_path: Path | None
) -> None:
    """Append and replay throughput of the bus vs raw nats-py on the same server.

    The defaults take under a minute on two cores; tighter medians: --repeat 9.
    """
    server = None
    if nats_url is None:
        server = EmbeddedNats().start()
        nats_url = server.url
    try:
        result = event_loop.run(
            run_bench(nats_url, count=count, payload_bytes=payload_bytes, in_flight=in_flight, repeat=repeat)
        )
    finally:
        if server is not None:
            server.cleanup()
    Console().print(_table(result))
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2))
