"""The chaos proxy on real sockets: it relays, delays, blackholes (traffic passes after) and resets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from frontend.drill.proxy import ChaosProxy


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@pytest.fixture
async def proxy() -> AsyncIterator[ChaosProxy]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with ChaosProxy(("127.0.0.1", port)) as chaos:
        yield chaos
    server.close()


async def _round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> float:
    started = time.monotonic()
    writer.write(data)
    await writer.drain()
    assert await reader.readexactly(len(data)) == data
    return time.monotonic() - started


async def test_relays_and_adds_latency_in_each_direction(proxy: ChaosProxy) -> None:
    reader, writer = await asyncio.open_connection(*proxy.address)
    await _round_trip(reader, writer, b"hello")
    assert proxy.stats.chunks_delayed == 0  # no latency set: relayed as it came
    proxy.set_latency(0.15)
    slow = await _round_trip(reader, writer, b"world")
    assert slow >= 0.3  # 150 ms there and 150 ms back
    delayed = proxy.stats.chunks_delayed
    assert delayed >= 2
    proxy.heal()
    await _round_trip(reader, writer, b"again")
    assert proxy.stats.chunks_delayed == delayed  # healed: nothing more delayed
    writer.close()


async def test_a_blackhole_holds_traffic_and_new_connections_until_it_ends(proxy: ChaosProxy) -> None:
    reader, writer = await asyncio.open_connection(*proxy.address)
    await _round_trip(reader, writer, b"before")
    proxy.blackhole(True)
    writer.write(b"during")
    await writer.drain()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.readexactly(6), 0.4)
    late_reader, late_writer = await asyncio.open_connection(*proxy.address)  # accepted, not relayed
    late_writer.write(b"late")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(late_reader.readexactly(4), 0.3)
    assert proxy.stats.chunks_held >= 1 and proxy.stats.connections_held == 1
    proxy.blackhole(False)
    assert await asyncio.wait_for(reader.readexactly(6), 2) == b"during"  # TCP kept it: delivered now
    assert await asyncio.wait_for(late_reader.readexactly(4), 2) == b"late"
    writer.close()
    late_writer.close()


async def test_reset_aborts_every_connection_with_a_reset(proxy: ChaosProxy) -> None:
    connections = [await asyncio.open_connection(*proxy.address) for _ in range(3)]
    for reader, writer in connections:
        await _round_trip(reader, writer, b"x")
    assert proxy.reset_all() == 3
    for reader, writer in connections:
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(reader.readexactly(1), 2)
        writer.close()
    reader, writer = await asyncio.open_connection(*proxy.address)  # new connections work again
    await _round_trip(reader, writer, b"fresh")
    writer.close()
