"""JetStream-only behaviour: crashes of the server, outages, provisioning, consumer recovery."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.js import api

from bus import AppendTimeout, JetStreamBus, NoResponders, StreamConfig
from bus.server import EmbeddedNats
from schemas import Subjects
from tests.bus.helpers import collect, short_config, take


@pytest.fixture
async def own_server(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    """A nats-server this test may kill and restart (same store directory, same port)."""
    server = EmbeddedNats(store_dir=tmp_path / "store")
    await asyncio.to_thread(server.start)
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop)


async def _restart_after(server: EmbeddedNats, delay: float) -> None:
    await asyncio.sleep(delay)
    await asyncio.to_thread(server.start)


async def test_kill_9_loses_no_acknowledged_event_and_clients_reconnect_by_themselves(
    own_server: EmbeddedNats,
) -> None:
    names = Subjects("crash")
    config = short_config(own_server.url, names, ack_timeout=0.3, append_timeout=30.0)
    async with JetStreamBus(config) as writer, JetStreamBus(config) as reader:
        tail = reader.tail(names.events_stream, from_seq=1)
        acknowledged = {}
        for i in range(50):
            acknowledged[f"before-{i}"] = await writer.append(
                names.req(f"r{i}"), b"before", msg_id=f"before-{i}"
            )

        restart: asyncio.Task[None] | None = None
        async with writer.appender(max_in_flight=32) as pipe:
            futures = {}
            for i in range(300):
                futures[f"during-{i}"] = await pipe.append(
                    names.req(f"r{i}"), b"during", msg_id=f"during-{i}"
                )
                if i == 100:
                    own_server.kill()  # SIGKILL: no flush, no goodbye
                    restart = asyncio.create_task(_restart_after(own_server, 0.5))
        assert restart is not None
        await restart
        acknowledged.update({msg_id: future.result() for msg_id, future in futures.items()})
        acknowledged["after"] = await writer.append(names.req("r0"), b"after", msg_id="after")

        stored = await collect(reader.replay(names.events_stream))
        by_id = {m.headers["Nats-Msg-Id"]: m.position for m in stored}
        assert len(stored) == len(by_id) == 351  # every event once, none twice
        assert by_id == acknowledged  # each at the position its ack reported
        assert [m.position.seq for m in stored] == list(range(1, 352))

        async with tail:  # the live reader came through the crash without gaps or repeats
            followed = await take(tail, 351, timeout=20)
        assert [m.position.seq for m in followed] == list(range(1, 352))
        assert writer.num_reconnects >= 1 and reader.num_reconnects >= 1
        assert writer.is_connected and reader.is_connected


async def test_an_append_during_an_outage_waits_and_then_fails_at_its_deadline(
    own_server: EmbeddedNats,
) -> None:
    names = Subjects("outage")
    async with JetStreamBus(short_config(own_server.url, names, ack_timeout=0.2)) as bus:
        await bus.append(names.req("r1"), b"stored")
        own_server.kill()
        waiting = asyncio.create_task(bus.append(names.req("r1"), b"waits", msg_id="w-1", timeout=20))
        await asyncio.sleep(0.6)
        assert not waiting.done()  # no crash, no error: it waits for the server
        await asyncio.to_thread(own_server.start)
        assert (await waiting).seq == 2

        own_server.kill()
        with pytest.raises(AppendTimeout) as raised:
            await bus.append(names.req("r1"), b"never", timeout=0.6)
        assert isinstance(raised.value, TimeoutError)
        await asyncio.to_thread(own_server.start)
        assert await bus.last_seq(names.events_stream) == 2


async def test_streams_are_file_backed_and_provisioning_updates_limits(
    nats_url: str, subjects: Subjects
) -> None:
    first = short_config(nats_url, subjects)
    changed = short_config(
        nats_url,
        subjects,
        streams=StreamConfig(events_max_age=7200.0, loads_max_age=600.0, loads_max_msgs_per_subject=7),
    )
    async with JetStreamBus(first) as bus:
        position = await bus.append(subjects.req("r1"), b"kept")
    async with JetStreamBus(changed) as bus:  # connecting again: update, not fail, keep messages
        jsm = bus.client.jsm()
        events = await jsm.stream_info(subjects.events_stream)
        loads = await jsm.stream_info(subjects.loads_stream)
        assert events.config.storage == loads.config.storage == api.StorageType.FILE
        assert events.config.subjects == [subjects.events_all]
        assert loads.config.subjects == [subjects.loads_all]
        assert events.config.max_age == 7200.0
        assert loads.config.max_age == 600.0
        assert loads.config.max_msgs_per_subject == 7
        assert events.config.duplicate_window == 120.0
        assert [m.position for m in await collect(bus.replay(subjects.events_stream))] == [position]
        for stream in (subjects.events_stream, subjects.loads_stream, f"KV_{subjects.kv_bucket}"):
            await jsm.delete_stream(stream)


async def test_a_tail_recovers_when_its_consumer_is_deleted_under_it(
    nats_url: str, subjects: Subjects
) -> None:
    async with JetStreamBus(short_config(nats_url, subjects)) as bus:
        async with bus.tail(subjects.events_stream, from_seq=1) as tail:
            await bus.append(subjects.req("r1"), b"1")
            assert [m.data for m in await take(tail, 1)] == [b"1"]
            jsm = bus.client.jsm()
            [consumer] = await jsm.consumers_info(subjects.events_stream)
            await jsm.delete_consumer(subjects.events_stream, consumer.name)
            await bus.append(subjects.req("r1"), b"2")
            await bus.append(subjects.req("r1"), b"3")
            assert [m.data for m in await take(tail, 2, timeout=10)] == [b"2", b"3"]
        for stream in (subjects.events_stream, subjects.loads_stream, f"KV_{subjects.kv_bucket}"):
            await bus.client.jsm().delete_stream(stream)


async def test_a_long_replay_with_a_slow_reader_is_complete_and_ordered(
    nats_url: str, subjects: Subjects
) -> None:
    """Enough messages to need several flow-control rounds while the reader lags."""
    async with JetStreamBus(short_config(nats_url, subjects)) as bus:
        payload = b"x" * 2048
        async with bus.appender(max_in_flight=256) as pipe:
            for i in range(3000):
                await pipe.append(subjects.sched("bench"), payload, msg_id=f"m{i}")
        seqs = []
        async with bus.replay(subjects.events_stream) as feed:
            async for message in feed:
                seqs.append(message.position.seq)
                if len(seqs) % 500 == 0:
                    await asyncio.sleep(0.05)
        assert seqs == list(range(1, 3001))
        for stream in (subjects.events_stream, subjects.loads_stream, f"KV_{subjects.kv_bucket}"):
            await bus.client.jsm().delete_stream(stream)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hold: float) -> None:
    """Relay in order; a SUB or UNSUB line, and all after it in its chunk, waits ``hold`` seconds."""
    try:
        while data := await reader.read(65536):
            found = data.find(b"SUB ") if hold else -1
            if found >= 0:
                newline = data.rfind(b"\r\n", 0, found)
                line_start = newline + 2 if newline >= 0 else 0
                writer.write(data[:line_start])
                await writer.drain()
                await asyncio.sleep(hold)
                data = data[line_start:]
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def test_serve_returns_once_a_slow_server_has_the_subscription(
    nats_url: str, subjects: Subjects
) -> None:
    # a server slow to read the serving client's SUB (a loaded machine), through a relay that holds it back
    upstream = nats_url.removeprefix("nats://").rsplit(":", 1)
    tasks: set[asyncio.Task[None]] = set()

    async def relay(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection(upstream[0], int(upstream[1]))
        for task in (_pipe(client_reader, server_writer, 0.5), _pipe(server_reader, client_writer, 0.0)):
            tasks.add(asyncio.create_task(task))

    proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
    port = proxy.sockets[0].getsockname()[1]
    server = JetStreamBus(short_config(f"nats://127.0.0.1:{port}", subjects))
    client = JetStreamBus(short_config(nats_url, subjects))
    try:
        await server.connect()
        await client.connect()
        subject = subjects.rpc_dispatch
        service = await server.serve(subject, _echo)
        # the other client's request right away finds the responder ...
        assert (await client.request(subject, b"here?", timeout=5)).data == b"here?"
        await service.stop()
        # ... and, once stop() returns, finds none
        with pytest.raises(NoResponders):
            await client.request(subject, b"gone?", timeout=5)
    finally:
        await client.close()
        await server.close()
        proxy.close()
        for task in tasks:
            task.cancel()


async def _echo(data: bytes, headers: dict[str, str]) -> bytes:
    return data


def test_closing_after_the_server_died_loses_nothing_more_and_raises_nothing(tmp_path: Path) -> None:
    """A component stopping after its nats-server (kill -9, a dead parent) exits cleanly: on uvloop
    nats-py's close flushed the buffered publishes into the dead socket and raised."""
    from bus import event_loop

    server = EmbeddedNats(store_dir=tmp_path / "store").start()

    async def publish_then_close() -> None:
        bus = JetStreamBus(short_config(server.url, Subjects("closing")))
        await bus.connect()
        await bus.publish("closing.x", b"before")
        server.kill()
        await asyncio.sleep(0.5)  # the client sees the socket close and starts reconnecting
        for _ in range(3):
            with contextlib.suppress(Exception):  # buffered while reconnecting, or refused
                await bus.publish("closing.x", b"after")
        await bus.close()

    try:
        event_loop.run(publish_then_close())
    finally:
        server.cleanup()
