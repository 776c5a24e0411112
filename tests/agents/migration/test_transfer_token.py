"""A real agent's KV transport accepts a migration buffer only with the token its Ack issued.

A test client plays the source of a migration towards a real agent (sim
engine, TCP transport, real nats-server): it sends ``PreAllocate`` on the bus
and gets the agent's ``Ack`` with a transfer token. A buffer with a guessed
token, or for a stage nothing was reserved for, is refused before its bytes
are sent; the buffer with the token lands; sending it again (a replay) is
refused as a duplicate. Tokens are unguessable, differ per reservation, and
the copy of the ``Ack`` in the event log does not carry the token.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from agents.migration.destination import payload_bytes_per_block
from schemas import Codec
from schemas.migration import Ack, PreAllocate
from tests.agents.agent_cluster import agent_cluster, fast_agent_config, sim_engine
from transport import TransferHeader, TransferRejected, TransportConfig
from transport.factory import open_transport


async def _ack(cluster: object, subscription: object, codec: Codec, **pre_allocate: object) -> Ack:
    message = PreAllocate(**pre_allocate)  # type: ignore[arg-type]
    bus = cluster.bus  # type: ignore[attr-defined]
    subject = cluster.subjects.rpc_mig(message.destination_id)  # type: ignore[attr-defined]
    await bus.publish(subject, codec.encode(message, time=time.time()))
    async with asyncio.timeout(5):
        async for received in subscription:  # type: ignore[attr-defined]
            body = codec.decode(received.data).body
            if isinstance(body, Ack) and body.migration_id == pre_allocate["migration_id"]:
                return body
    raise AssertionError("no Ack")


async def test_only_the_buffer_carrying_the_acks_token_lands_and_only_once(nats_url: str) -> None:
    codec = Codec(producer="fake-source")
    async with agent_cluster(nats_url) as cluster:
        agent = await cluster.add(sim_engine(), fast_agent_config("a2"))
        await cluster.add(sim_engine(), fast_agent_config("a3"))
        replies = await cluster.bus.subscribe(cluster.subjects.rpc_mig("src"))
        common = {"request_id": "r1", "source_id": "src", "stage": 0, "num_blocks": 2}
        ack = await _ack(cluster, replies, codec, migration_id="m1", destination_id="a2", **common)
        # another reservation (one incoming migration per agent at a time: on another agent)
        other = await _ack(cluster, replies, codec, migration_id="m2", destination_id="a3", **common)
        assert len(ack.transfer_token) >= 32 and ack.transfer_token != other.transfer_token
        info = agent.engine.info
        nbytes = 2 * payload_bytes_per_block(info.engine, info.bytes_per_block)
        payload = bytes(nbytes)
        address = agent.transport.address
        async with await open_transport(TransportConfig(kind="tcp")) as sender:
            forged = [
                (TransferHeader(migration_id="m1", stage=0, nbytes=nbytes), "reservation_mismatch"),
                (
                    TransferHeader(migration_id="m1", stage=0, nbytes=nbytes, reservation_id="2-00000000"),
                    "reservation_mismatch",
                ),
                # the token of another reservation
                (
                    TransferHeader(
                        migration_id="m1", stage=0, nbytes=nbytes, reservation_id=other.transfer_token
                    ),
                    "reservation_mismatch",
                ),
                (
                    TransferHeader(
                        migration_id="m1", stage=1, nbytes=nbytes, reservation_id=ack.transfer_token
                    ),
                    "unknown_transfer",
                ),
            ]
            for header, reason in forged:
                with pytest.raises(TransferRejected) as refused:
                    await sender.send(address, header, payload, timeout=5)
                assert refused.value.reason == reason
            real = TransferHeader(
                migration_id="m1", stage=0, nbytes=nbytes, reservation_id=ack.transfer_token
            )
            await sender.send(address, real, payload, timeout=5)
            with pytest.raises(TransferRejected) as replayed:
                await sender.send(address, real, payload, timeout=5)
            assert replayed.value.reason == "duplicate"
        rejected = agent.transport.stats().rejected
        assert rejected["reservation_mismatch"] == 3 and rejected["duplicate"] == 1
        logged = [
            body
            for _, envelope in await cluster.stored(f"{cluster.subjects.prefix}.ev.mig.>")
            if isinstance(body := envelope.body, Ack)
        ]
        assert logged and all(entry.transfer_token == "" for entry in logged)
        await replies.unsubscribe()
