"""What rides in messages (both implementations): malformed payloads, trace context, lifecycle errors."""

from __future__ import annotations

import msgspec
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from bus import Bus, JetStreamBus, MemoryBus, NotConnected, tracing
from schemas import Codec, Subjects, TokenDelta
from tests.bus.conftest import MakeBus
from tests.bus.helpers import collect, short_config, take


def _delta(first_index: int) -> TokenDelta:
    return TokenDelta(
        request_id="r1", instance_id="i1", owner_epoch=0, first_index=first_index, token_ids=(first_index,)
    )


async def test_a_subscriber_counts_malformed_messages_and_keeps_going(bus: Bus) -> None:
    producer, consumer = Codec("agent-i1"), Codec("frontend")
    subject = bus.config.subjects.tok("r1")
    subscription = await bus.subscribe(subject)
    payloads = [
        producer.encode(_delta(0), time=1.0),
        b"\xc1 not msgpack",
        producer.encode(_delta(1), time=1.0),
        msgspec.msgpack.encode({"body": {"type": "no_such_message"}}),
        b"",
        producer.encode(_delta(2), time=1.0),
    ]
    for payload in payloads:
        await bus.publish(subject, payload)

    received = []
    async with subscription:
        for message in await take(subscription, len(payloads)):
            envelope = consumer.decode_or_none(message.data)
            if envelope is None:
                continue
            received.append(envelope.body)
    assert [delta.first_index for delta in received] == [0, 1, 2]  # type: ignore[union-attr]
    assert consumer.num_rejected == 3
    assert consumer.rejected["unknown_type"] == 1


async def test_trace_context_round_trips_through_append_replay_and_request(make_bus: MakeBus) -> None:
    server, client = await make_bus(), await make_bus()
    tracer = TracerProvider().get_tracer("test")
    names = client.config.subjects

    async def handler(data: bytes, headers: dict[str, str]) -> bytes:
        context = tracing.extract(headers)
        return format(trace.get_current_span(context).get_span_context().trace_id, "032x").encode()

    await server.serve(names.rpc_mig("i2"), handler)
    with tracer.start_as_current_span("migration") as span:
        trace_id = span.get_span_context().trace_id
        await client.append(names.mig("m1"), b"pre-allocate", headers=tracing.inject({}))
        reply = await client.request(
            names.rpc_mig("i2"), b"pre-allocate", timeout=5, headers=tracing.inject()
        )
        assert tracing.traceparent() == tracing.traceparent(tracing.inject())

    assert reply.data == format(trace_id, "032x").encode()
    [stored] = await collect(client.replay(names.events_stream))
    context = tracing.extract(stored.headers)
    assert trace.get_current_span(context).get_span_context().trace_id == trace_id
    assert tracing.traceparent(stored.headers) is not None


def test_trace_headers_are_read_in_any_letter_case() -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("s") as span:
        headers = dict(tracing.inject({}))
    shouted = {key.title(): value for key, value in headers.items()}
    assert "Traceparent" in shouted
    context = tracing.extract(shouted)
    extracted, original = trace.get_current_span(context).get_span_context(), span.get_span_context()
    assert (extracted.trace_id, extracted.span_id) == (original.trace_id, original.span_id)
    assert tracing.inject({}) == {}  # no active span: nothing added
    assert tracing.traceparent({"TRACEPARENT": "x"}) == "x"


@pytest.mark.parametrize("kind", ["jetstream", "memory"])
async def test_using_a_bus_before_connect_or_after_close_raises_not_connected(kind: str) -> None:
    config = short_config("nats://127.0.0.1:1", Subjects("notconnected"))
    bus = JetStreamBus(config) if kind == "jetstream" else MemoryBus(config)
    with pytest.raises(NotConnected):
        await bus.append(config.subjects.req("r1"), b"x")
    with pytest.raises(NotConnected):
        await bus.publish(config.subjects.tok("r1"), b"x")
    if kind == "jetstream":
        with pytest.raises(NotConnected):  # nothing listens on port 1
            await bus.connect()
    else:
        await bus.connect()
        await bus.close()
        with pytest.raises(NotConnected):
            await bus.kv_get("k")
