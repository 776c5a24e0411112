"""The KVTransport contract, run unchanged over inproc, TCP and UCX (over TCP on loopback)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import pytest
import torch

from tests.transport.conftest import Pair, config_for
from transport import (
    KVTransport,
    PeerUnreachable,
    TransferCancelled,
    TransferHeader,
    TransferRejected,
    TransferTimeout,
    TransportClosed,
    create_transport,
)

MiB = 1 << 20


def header(migration_id: str, stage: int, nbytes: int, **extra: object) -> TransferHeader:
    return TransferHeader(migration_id=migration_id, stage=stage, nbytes=nbytes, **extra)  # type: ignore[arg-type]


async def test_buffer_lands_intact_in_the_expected_slot(pair: Pair) -> None:
    payload = os.urandom(3 * MiB + 17)
    into = bytearray(len(payload))
    pending = pair.receiver.expect("mig-1", 0, len(payload), reservation_id="r0", into=into)
    await pair.sender.send(pair.address, header("mig-1", 0, len(payload), reservation_id="r0"), payload)
    landed = await pending.wait(timeout=10)
    assert isinstance(pair.sender, KVTransport) and isinstance(pair.receiver, KVTransport)
    assert landed is into
    assert bytes(into) == payload
    stats = pair.receiver.stats()
    assert (stats.transfers_received, stats.bytes_received, stats.rejected_total) == (1, len(payload), 0)
    assert pair.sender.stats().bytes_sent == len(payload)


async def test_without_into_the_receiver_allocates(pair: Pair) -> None:
    payload = memoryview(os.urandom(4096))
    pending = pair.receiver.expect("mig-alloc", 2, len(payload))
    await pair.sender.send(pair.address, header("mig-alloc", 2, len(payload)), payload)
    assert bytes(await pending) == bytes(payload)


async def test_torch_tensor_payload_lands_byte_for_byte(pair: Pair) -> None:
    generator = torch.Generator().manual_seed(7)
    kv = torch.randn(2, 4, 16, 8, generator=generator).to(torch.bfloat16)  # [k/v, blocks, tokens, dim]
    into = torch.zeros_like(kv)
    nbytes = kv.numel() * kv.element_size()
    pending = pair.receiver.expect("mig-t", 0, nbytes, into=into)
    await pair.sender.send(pair.address, header("mig-t", 0, nbytes), kv)
    assert (await pending.wait(timeout=10)) is into
    assert torch.equal(into.view(torch.int16), kv.view(torch.int16))


async def test_tensor_lands_in_a_plain_buffer_and_bytes_in_a_tensor(pair: Pair) -> None:
    kv = torch.arange(1024, dtype=torch.float16)
    pending = pair.receiver.expect("mig-mixed", 0, 2048)
    await pair.sender.send(pair.address, header("mig-mixed", 0, 2048), kv)
    assert bytes(await pending) == kv.numpy().tobytes()
    into = torch.empty(1024, dtype=torch.float16)
    pending = pair.receiver.expect("mig-mixed", 1, 2048, into=into)
    await pair.sender.send(pair.address, header("mig-mixed", 1, 2048), kv.numpy().tobytes())
    await pending
    assert torch.equal(into, kv)


async def test_stray_buffers_are_rejected_counted_and_the_receiver_keeps_working(pair: Pair) -> None:
    pending = pair.receiver.expect("mig-ok", 0, 100, reservation_id="res-a")
    strays = [
        (header("mig-unknown", 0, 100), "unknown_transfer"),
        (header("mig-ok", 0, 99), "size_mismatch"),
        (header("mig-ok", 0, 100, reservation_id="res-b"), "reservation_mismatch"),
        (header("mig-ok", 5, 100, reservation_id="res-a"), "unknown_transfer"),
    ]
    for stray, reason in strays:
        with pytest.raises(TransferRejected) as rejected:
            await pair.sender.send(pair.address, stray, bytes(stray.nbytes))
        assert rejected.value.reason == reason
    assert not pending.done()
    await pair.sender.send(pair.address, header("mig-ok", 0, 100, reservation_id="res-a"), b"\x01" * 100)
    assert bytes(await pending) == b"\x01" * 100
    with pytest.raises(TransferRejected) as again:
        await pair.sender.send(pair.address, header("mig-ok", 0, 100, reservation_id="res-a"), bytes(100))
    assert again.value.reason == "duplicate"
    stats = pair.receiver.stats()
    assert stats.rejected == {
        "duplicate": 1,
        "reservation_mismatch": 1,
        "size_mismatch": 1,
        "unknown_transfer": 2,
    }
    assert stats.transfers_received == 1
    assert pair.sender.stats().sends_rejected == 5


async def test_cancel_drops_expectations_and_rejects_late_buffers(pair: Pair) -> None:
    into = bytearray(b"\xee" * 64)
    stage0 = pair.receiver.expect("mig-c", 0, 64, into=into)
    stage1 = pair.receiver.expect("mig-c", 1, 64)
    other = pair.receiver.expect("mig-keep", 0, 64)
    assert pair.receiver.cancel("mig-c") == 2
    for pending in (stage0, stage1):
        with pytest.raises(TransferCancelled):
            await pending
    for stage in (0, 1, 7):
        with pytest.raises(TransferRejected) as rejected:
            await pair.sender.send(pair.address, header("mig-c", stage, 64), bytes(64))
        assert rejected.value.reason == "cancelled"
    assert into == bytearray(b"\xee" * 64), "a rejected buffer must not touch the slot"
    await pair.sender.send(pair.address, header("mig-keep", 0, 64), b"k" * 64)
    assert bytes(await other) == b"k" * 64
    assert pair.receiver.stats().rejected == {"cancelled": 3}


async def test_a_waiter_that_times_out_rejects_the_late_buffer(pair: Pair) -> None:
    pending = pair.receiver.expect("mig-late", 0, 8)
    with pytest.raises(TransferTimeout):
        await pending.wait(timeout=0.05)
    with pytest.raises(TransferRejected) as rejected:
        await pair.sender.send(pair.address, header("mig-late", 0, 8), bytes(8))
    assert rejected.value.reason == "expired"


async def test_concurrent_migrations_do_not_mix(pair: Pair) -> None:
    size = 256 * 1024
    slots = {(f"mig-{m}", stage): bytearray(size) for m in range(5) for stage in range(3)}
    payloads = {key: bytes([i + 1]) * size for i, key in enumerate(slots)}
    pendings = [pair.receiver.expect(m, s, size, into=slots[(m, s)]) for (m, s) in slots]

    async def migrate(migration_id: str) -> None:
        for stage in range(3):
            payload = payloads[(migration_id, stage)]
            await pair.sender.send(pair.address, header(migration_id, stage, size), payload)

    await asyncio.gather(*(migrate(f"mig-{m}") for m in range(5)))
    await asyncio.gather(*(p.wait(timeout=10) for p in pendings))
    assert all(slots[key] == payloads[key] for key in slots)
    assert pair.receiver.stats().transfers_received == 15


async def test_sending_to_a_dead_address_fails_fast_with_a_typed_error(
    pair: Pair, dead_address: Callable[[], str]
) -> None:
    async with asyncio.timeout(5):
        with pytest.raises(PeerUnreachable):
            await pair.sender.send(dead_address(), header("mig-d", 0, 16), bytes(16))


async def test_a_large_buffer_moves_intact(pair: Pair) -> None:
    payload = bytearray(os.urandom(MiB)) * 64
    into = bytearray(len(payload))
    pending = pair.receiver.expect("mig-big", 0, len(payload), into=into)
    await pair.sender.send(pair.address, header("mig-big", 0, len(payload)), payload)
    await pending.wait(timeout=30)
    assert into == payload


async def test_a_bad_checksum_is_rejected_and_a_good_retry_lands(pair: Pair) -> None:
    import zlib

    payload = os.urandom(5000)
    pending = pair.receiver.expect("mig-crc", 0, len(payload))
    bogus = header("mig-crc", 0, len(payload), checksum=(zlib.crc32(payload) + 1) & 0xFFFFFFFF)
    with pytest.raises(TransferRejected) as rejected:
        await pair.sender.send(pair.address, bogus, payload)
    assert rejected.value.reason == "checksum_mismatch"
    good = header("mig-crc", 0, len(payload), checksum=zlib.crc32(payload))
    await pair.sender.send(pair.address, good, payload)
    assert bytes(await pending) == payload


async def test_checksumming_sender_round_trip(kind: str) -> None:
    sender = create_transport(config_for(kind, checksum=True))
    receiver = create_transport(config_for(kind))
    await sender.start()
    address = await receiver.start()
    try:
        pending = receiver.expect("mig-sum", 0, 1000)
        await sender.send(address, header("mig-sum", 0, 1000), b"s" * 1000)
        assert bytes(await pending) == b"s" * 1000
    finally:
        await sender.close()
        await receiver.close()


async def test_a_pooled_connection_to_a_restarted_peer_is_replaced(kind: str) -> None:
    sender = create_transport(config_for(kind))
    first = create_transport(config_for(kind, inproc_name="restarting"))
    await sender.start()
    address = await first.start()
    port = 0 if kind == "inproc" else int(address.rsplit(":", 1)[1])
    try:
        pending = first.expect("mig-r", 0, 10)
        await sender.send(address, header("mig-r", 0, 10), b"0123456789")
        await pending
        await first.close()
        with pytest.raises(PeerUnreachable):
            await sender.send(address, header("mig-r", 1, 10), bytes(10))
        second = create_transport(config_for(kind, inproc_name="restarting", port=port))
        assert await second.start() == address
        try:
            pending = second.expect("mig-r", 1, 10)
            await sender.send(address, header("mig-r", 1, 10), b"9876543210")
            assert bytes(await pending) == b"9876543210"
        finally:
            await second.close()
    finally:
        await sender.close()


async def test_close_fails_pending_expectations_and_later_sends(kind: str) -> None:
    transport = create_transport(config_for(kind))
    await transport.start()
    pending = transport.expect("mig-x", 0, 4)
    await transport.close()
    with pytest.raises(TransportClosed):
        await pending
    with pytest.raises(TransportClosed):
        await transport.send("tcp://127.0.0.1:1", header("mig-x", 0, 4), bytes(4))
    with pytest.raises(TransportClosed):
        transport.expect("mig-x", 1, 4)


async def test_header_must_match_the_payload_size(pair: Pair) -> None:
    with pytest.raises(ValueError, match="payload has 3"):
        await pair.sender.send(pair.address, header("mig-v", 0, 4), b"abc")


async def test_a_paced_send_lands_as_one_buffer_and_asks_for_each_piece_in_order(pair: Pair) -> None:
    payload = os.urandom(2 * MiB + 5)
    asked: list[int] = []

    async def next_chunk(offset: int) -> memoryview:
        asked.append(offset)
        await asyncio.sleep(0.001)  # the sender decides when the next piece goes
        return memoryview(payload)[offset : offset + 300_000]

    pending = pair.receiver.expect("mig-paced", 0, len(payload), reservation_id="r")
    await pair.sender.send_paced(
        pair.address, header("mig-paced", 0, len(payload), reservation_id="r"), next_chunk
    )
    assert bytes(await pending.wait(timeout=10)) == payload
    assert asked == list(range(0, len(payload), 300_000))
    assert pair.sender.stats().bytes_sent == len(payload)


async def test_a_paced_send_whose_pieces_overrun_the_header_fails(pair: Pair) -> None:
    async def too_much(offset: int) -> bytes:
        return b"x" * 700

    pair.receiver.expect("mig-over", 0, 1000)
    with pytest.raises(ValueError, match="does not fit"):
        await pair.sender.send_paced(pair.address, header("mig-over", 0, 1000), too_much)
