"""TCP-specific robustness: misbehaving peers on a real socket do not hurt the receiver."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from transport import TransferHeader, TransportConfig
from transport.address import parse_host_port
from transport.tcp import TcpTransport
from transport.wire import FRAME_PREFIX, Offer, Verdict, frame_control, unframe_control


async def read_frame(reader: asyncio.StreamReader) -> object:
    prefix = await reader.readexactly(FRAME_PREFIX.size)
    (length,) = FRAME_PREFIX.unpack(prefix)
    return unframe_control(prefix + await reader.readexactly(length))


@pytest.fixture
async def receiver() -> AsyncIterator[TcpTransport]:
    transport = TcpTransport(TransportConfig(kind="tcp"))
    await transport.start()
    yield transport
    await transport.close()


async def test_garbage_on_the_socket_is_dropped_and_the_receiver_keeps_working(
    receiver: TcpTransport,
) -> None:
    host, port = parse_host_port(receiver.address, "tcp")
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(FRAME_PREFIX.pack(5) + b"\xc1\xc1\xc1\xc1\xc1")
    await writer.drain()
    assert await reader.read() == b"", "the receiver hangs up on a peer that is not speaking the protocol"
    writer.close()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(FRAME_PREFIX.pack(1 << 30))  # an absurd control frame length
    await writer.drain()
    assert await reader.read() == b""
    writer.close()

    pending = receiver.expect("m", 0, 4)
    async with TcpTransport(TransportConfig(kind="tcp")) as sender:
        await sender.send(receiver.address, TransferHeader(migration_id="m", stage=0, nbytes=4), b"good")
    assert bytes(await pending) == b"good"


async def test_a_connection_dropped_mid_payload_leaves_the_slot_waiting_for_a_retry(
    receiver: TcpTransport,
) -> None:
    into = bytearray(1000)
    pending = receiver.expect("m", 3, 1000, into=into)
    host, port = parse_host_port(receiver.address, "tcp")
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(frame_control(Offer(header=TransferHeader(migration_id="m", stage=3, nbytes=1000))))
    assert await read_frame(reader) == Verdict(accepted=True)
    writer.write(b"x" * 400)
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    await asyncio.sleep(0.05)
    assert not pending.done()

    async with TcpTransport(TransportConfig(kind="tcp")) as sender:
        await sender.send(
            receiver.address, TransferHeader(migration_id="m", stage=3, nbytes=1000), b"y" * 1000
        )
    assert (await pending.wait(timeout=5)) is into
    assert into == b"y" * 1000
    assert receiver.stats().rejected_total == 0


async def test_peers_are_told_the_advertised_host_while_the_listener_binds_the_bind_host() -> None:
    """``advertise_host`` (``shoal agent --transport-advertise``): bind one address, advertise another."""
    config = TransportConfig(kind="tcp", host="127.0.0.1", advertise_host="localhost")
    async with TcpTransport(config) as advertised, TcpTransport(TransportConfig(kind="tcp")) as plain:
        host, port = parse_host_port(advertised.address, "tcp")
        assert host == "localhost" and port > 0
        assert parse_host_port(plain.address, "tcp")[0] == "127.0.0.1"
        _, writer = await asyncio.open_connection("localhost", port)  # reachable where advertised
        writer.close()
