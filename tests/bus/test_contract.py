"""The Bus contract, run against the real nats-server and the in-memory bus alike.

Every test here takes ``bus`` or ``make_bus``, which are parametrized over both
implementations: a behaviour the simulator relies on in memory is the
behaviour production gets from JetStream.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from bus import (
    EXPECTED_LAST_SUBJECT_SEQ_HEADER,
    MSG_ID_HEADER,
    AppendFailed,
    Bus,
    HandlerFailed,
    InvalidName,
    NoResponders,
    RequestTimeout,
    StreamNotFound,
)
from bus.protocol import StreamConfig
from tests.bus.conftest import MakeBus
from tests.bus.helpers import collect, take


async def test_appends_get_increasing_positions_and_replay_returns_them_in_order(bus: Bus) -> None:
    names = bus.config.subjects
    subjects = [names.instance("i1"), names.sched("dispatch"), names.mig("m1"), names.req("r1")] * 3
    before = time.time()
    positions = [await bus.append(subject, f"event-{i}".encode()) for i, subject in enumerate(subjects)]

    assert [p.seq for p in positions] == list(range(1, 13))
    assert {p.stream for p in positions} == {names.events_stream}
    replayed = await collect(bus.replay(names.events_stream))
    assert [m.position for m in replayed] == positions
    assert [m.subject for m in replayed] == subjects
    assert [m.data for m in replayed] == [f"event-{i}".encode() for i in range(12)]
    assert all(before - 1 <= m.time <= time.time() + 1 for m in replayed)
    assert [m.time for m in replayed] == sorted(m.time for m in replayed)
    assert await bus.last_seq(names.events_stream) == 12


async def test_a_retried_append_with_the_same_message_id_is_stored_once(bus: Bus) -> None:
    names = bus.config.subjects
    first = await bus.append(names.sched("dispatch"), b"decision", msg_id="dispatch-42")
    retried = await bus.append(names.sched("dispatch"), b"decision", msg_id="dispatch-42")
    other = await bus.append(names.sched("dispatch"), b"next", msg_id="dispatch-43")

    assert retried == first
    assert other.seq == first.seq + 1
    replayed = await collect(bus.replay(names.events_stream))
    assert [m.data for m in replayed] == [b"decision", b"next"]
    assert [m.headers[MSG_ID_HEADER] for m in replayed] == ["dispatch-42", "dispatch-43"]


async def test_an_append_whose_ack_was_lost_is_not_stored_twice(bus: Bus) -> None:
    """The first attempt reached the stream but no ack came back; the retry reuses the id."""
    names = bus.config.subjects
    await bus.publish(names.req("r1"), b"arrived", headers={MSG_ID_HEADER: "req-r1-arrived"})
    position = await bus.append(names.req("r1"), b"arrived", msg_id="req-r1-arrived")

    assert position.seq == 1
    assert await bus.last_seq(names.events_stream) == 1
    assert [m.data for m in await collect(bus.replay(names.events_stream))] == [b"arrived"]


async def test_appends_without_an_id_are_each_stored(bus: Bus) -> None:
    names = bus.config.subjects
    first = await bus.append(names.req("r1"), b"same bytes")
    second = await bus.append(names.req("r1"), b"same bytes")
    assert second.seq == first.seq + 1
    replayed = await collect(bus.replay(names.events_stream))
    assert len({m.headers[MSG_ID_HEADER] for m in replayed}) == 2


async def test_replay_from_a_sequence_up_to_a_sequence_and_by_subject(bus: Bus) -> None:
    names = bus.config.subjects
    kinds = [names.sched("dispatch"), names.req("r1"), names.mig("m1")]
    for i in range(10):
        await bus.append(kinds[i % 3], str(i + 1).encode())
    events = names.events_stream

    def seqs(messages: list) -> list[int]:  # type: ignore[type-arg]
        return [m.position.seq for m in messages]

    assert seqs(await collect(bus.replay(events, from_seq=4))) == list(range(4, 11))
    assert seqs(await collect(bus.replay(events, from_seq=4, until_seq=6))) == [4, 5, 6]
    assert seqs(await collect(bus.replay(events, subjects=[f"{names.prefix}.ev.req.*"]))) == [2, 5, 8]
    two_kinds = [f"{names.prefix}.ev.sched.*", f"{names.prefix}.ev.mig.>"]
    assert seqs(await collect(bus.replay(events, subjects=two_kinds))) == [1, 3, 4, 6, 7, 9, 10]
    assert seqs(await collect(bus.replay(events, from_seq=5, subjects=[names.req("r1")]))) == [5, 8]
    assert await collect(bus.replay(events, from_seq=11)) == []
    assert await collect(bus.replay(events, subjects=[f"{names.prefix}.ev.nothing.>"])) == []
    assert [m.data for m in await collect(bus.replay(events, from_seq=9))] == [b"9", b"10"]


async def test_replay_ends_at_the_last_sequence_when_it_starts_reading(bus: Bus) -> None:
    names = bus.config.subjects
    for i in range(3):
        await bus.append(names.req("r1"), b"%d" % i)
    async with bus.replay(names.events_stream) as feed:
        first = await anext(feed)
        for i in range(3, 6):
            await bus.append(names.req("r1"), b"%d" % i)
        rest = [m async for m in feed]
    assert [first.position.seq] + [m.position.seq for m in rest] == [1, 2, 3]


async def test_the_server_finds_the_first_message_stored_at_a_time(bus: Bus) -> None:
    names = bus.config.subjects
    for i in range(3):
        await bus.append(names.req("r1"), b"%d" % i)
    await asyncio.sleep(0.05)
    boundary = time.time()
    await asyncio.sleep(0.05)
    for i in range(3, 5):
        await bus.append(names.req("r1"), b"%d" % i)
    assert await bus.seq_at_time(names.events_stream, boundary) == 4
    assert await bus.seq_at_time(names.events_stream, 0.0) == 1
    assert await bus.seq_at_time(names.events_stream, time.time() + 60) is None


async def test_replay_of_an_unknown_stream_raises_stream_not_found(bus: Bus) -> None:
    with pytest.raises(StreamNotFound):
        await collect(bus.replay("no_such_stream"))
    with pytest.raises(StreamNotFound):
        await bus.last_seq("no_such_stream")


async def test_an_append_no_stream_captures_fails_fast(bus: Bus) -> None:
    with pytest.raises(StreamNotFound):
        await asyncio.wait_for(bus.append(f"{bus.config.subjects.prefix}.tok.r1", b"x", timeout=30), 5)
    with pytest.raises(InvalidName):
        await bus.append("bad subject", b"x")


async def test_tail_follows_new_appends_from_now_or_from_a_sequence(bus: Bus) -> None:
    names = bus.config.subjects
    await bus.append(names.req("r1"), b"old-1")
    await bus.append(names.req("r1"), b"old-2")

    async with bus.tail(names.events_stream, from_seq=2) as from_two:
        assert [m.data for m in await take(from_two, 1)] == [b"old-2"]
        await bus.append(names.req("r1"), b"new-3")
        assert [m.position.seq for m in await take(from_two, 1)] == [3]

    async with bus.tail(names.events_stream, subjects=[f"{names.prefix}.ev.mig.>"]) as live:
        waiting = asyncio.create_task(anext(live))
        while not waiting.done():  # keep appending until the tail has opened and seen one
            await bus.append(names.req("r1"), b"filtered out")
            await bus.append(names.mig("m1"), b"migration step")
            await asyncio.wait({waiting}, timeout=0.05)
        first = waiting.result()
    assert first.subject == names.mig("m1")
    assert first.position.seq > 3


async def test_pipelined_appends_keep_order_and_positions(bus: Bus) -> None:
    names = bus.config.subjects
    async with bus.appender(max_in_flight=8) as pipe:
        futures = []
        for i in range(100):
            futures.append(await pipe.append(names.load(f"i{i % 4}"), b"%d" % i, msg_id=f"load-{i}"))
            assert pipe.num_in_flight <= 8
        duplicate = await pipe.append(names.load("i1"), b"1", msg_id="load-1")
    positions = [future.result() for future in futures]
    assert [p.seq for p in positions] == list(range(1, 101))
    assert duplicate.result() == positions[1]
    replayed = await collect(bus.replay(names.loads_stream))
    assert [m.data for m in replayed] == [b"%d" % i for i in range(100)]


async def test_a_failed_pipelined_append_fails_its_future_and_the_flush(bus: Bus) -> None:
    names = bus.config.subjects
    pipe = bus.appender(max_in_flight=4)
    good = await pipe.append(names.req("r1"), b"ok")
    bad = await pipe.append(f"{names.prefix}.uncaptured", b"lost")
    with pytest.raises(AppendFailed):
        await pipe.flush()
    assert (await good).seq == 1
    with pytest.raises(StreamNotFound):
        await bad
    await pipe.flush()  # failures are reported once


async def test_loads_stream_keeps_a_bounded_number_of_reports_per_instance(make_bus: MakeBus) -> None:
    bus = await make_bus(
        streams=StreamConfig(events_max_age=3600.0, loads_max_age=3600.0, loads_max_msgs_per_subject=5)
    )
    names = bus.config.subjects
    for round_ in range(12):
        for instance in ("i1", "i2"):
            await bus.append(names.load(instance), f"{instance}-{round_}".encode())

    kept = await collect(bus.replay(names.loads_stream))
    assert await bus.last_seq(names.loads_stream) == 24
    assert len(kept) == 10
    for instance in ("i1", "i2"):
        mine = [m.data for m in kept if m.subject == names.load(instance)]
        assert mine == [f"{instance}-{r}".encode() for r in range(7, 12)]
    assert [m.position.seq for m in kept] == sorted(m.position.seq for m in kept)


async def test_request_reply_and_a_failing_handler(make_bus: MakeBus) -> None:
    server, client = await make_bus(), await make_bus()
    subject = server.config.subjects.rpc_agent("i1", "generate")

    async def reverse(data: bytes, headers: dict[str, str]) -> bytes:
        if data == b"boom":
            raise ValueError("cannot serve boom")
        return data[::-1] + headers.get("x-suffix", "").encode()

    service = await server.serve(subject, reverse)
    reply = await client.request(subject, b"abc", timeout=5, headers={"x-suffix": "!"})
    assert reply.data == b"cba!"
    with pytest.raises(HandlerFailed, match="ValueError: cannot serve boom"):
        await client.request(subject, b"boom", timeout=5)
    assert (service.num_handled, service.num_failed) == (1, 1)

    await service.stop()
    with pytest.raises(NoResponders):
        await client.request(subject, b"abc", timeout=5)



async def test_a_plain_function_handler_answers_each_request_and_a_failing_one_fails_fast(
    make_bus: MakeBus,
) -> None:
    """A handler that is a plain function (the scheduler's dispatch) is answered where the request
    arrives; requests sent together get their own replies, and an exception still reaches the caller."""
    server, client = await make_bus(), await make_bus()
    subject = server.config.subjects.rpc_dispatch
    seen: list[bytes] = []

    def place(data: bytes, headers: dict[str, str]) -> bytes:
        if data == b"boom":
            raise ValueError("cannot place boom")
        seen.append(data)
        return b"placed " + data

    service = await server.serve(subject, place, queue="scheduler")
    names = [f"r{k}".encode() for k in range(20)]
    replies = await asyncio.gather(*(client.request(subject, name, timeout=5) for name in names))
    assert [reply.data for reply in replies] == [b"placed " + name for name in names]
    assert sorted(seen) == sorted(names)
    with pytest.raises(HandlerFailed, match="ValueError: cannot place boom"):
        await client.request(subject, b"boom", timeout=5)
    assert (service.num_handled, service.num_failed) == (20, 1)
    await service.stop()

async def test_a_request_nobody_answers_times_out(make_bus: MakeBus) -> None:
    silent, client = await make_bus(), await make_bus()
    subject = silent.config.subjects.rpc_dispatch
    subscription = await silent.subscribe(subject)  # receives, never replies
    with pytest.raises(RequestTimeout) as raised:
        await client.request(subject, b"place me", timeout=0.3)
    assert isinstance(raised.value, TimeoutError)
    assert [m.data for m in await take(subscription, 1)] == [b"place me"]
    await subscription.unsubscribe()


async def test_a_request_to_no_subscriber_fails_with_no_responders_before_its_timeout(bus: Bus) -> None:
    with pytest.raises(NoResponders):
        await asyncio.wait_for(bus.request(bus.config.subjects.rpc_dispatch, b"x", timeout=30), 5)


async def test_queue_groups_share_messages_and_plain_subscribers_see_all(make_bus: MakeBus) -> None:
    a, b, c = await make_bus(), await make_bus(), await make_bus()
    subject = a.config.subjects.tok("r9")
    worker_1 = await a.subscribe(subject, queue="workers")
    worker_2 = await b.subscribe(subject, queue="workers")
    watcher = await c.subscribe(f"{a.config.subjects.prefix}.tok.*")
    for i in range(20):
        await c.publish(subject, b"%d" % i)

    assert [m.data for m in await take(watcher, 20)] == [b"%d" % i for i in range(20)]
    shared: list[bytes] = []
    async with asyncio.timeout(5):
        while len(shared) < 20:
            for worker in (worker_1, worker_2):
                try:
                    shared.append((await asyncio.wait_for(anext(worker), 0.05)).data)
                except TimeoutError:
                    pass
    assert sorted(shared) == sorted(b"%d" % i for i in range(20))
    with pytest.raises(TimeoutError):  # nothing was delivered twice
        await asyncio.wait_for(anext(worker_1), 0.1)


async def test_unsubscribe_ends_the_iteration(bus: Bus) -> None:
    subscription = await bus.subscribe(bus.config.subjects.tok("r1"))
    waiting = asyncio.create_task(anext(subscription))
    await asyncio.sleep(0.01)
    await subscription.unsubscribe()
    with pytest.raises(StopAsyncIteration):
        await waiting


async def test_an_append_expecting_an_empty_subject_succeeds_once(bus: Bus) -> None:
    """First-outcome-wins: one claim is stored; a rival claim, and even a retry of the winner, is refused."""
    names = bus.config.subjects
    outcome = f"{names.mig('m7')}.outcome"
    expect_empty = {EXPECTED_LAST_SUBJECT_SEQ_HEADER: "0"}
    await bus.append(names.mig("m7"), b"pre-allocate")  # other subjects do not count
    claimed = await bus.append(outcome, b"commit-ack", msg_id="m7-dest", headers=expect_empty)
    for rival, msg_id in ((b"abort", "m7-src"), (b"commit-ack", "m7-dest")):
        with pytest.raises(AppendFailed) as refused:
            await bus.append(outcome, rival, msg_id=msg_id, headers=expect_empty)
        assert refused.value.err_code == 10071
    follow_up = {EXPECTED_LAST_SUBJECT_SEQ_HEADER: str(claimed.seq)}
    assert (await bus.append(outcome, b"note", headers=follow_up)).seq == claimed.seq + 1
    stored = await collect(bus.replay(names.events_stream, subjects=[outcome]))
    assert [m.data for m in stored] == [b"commit-ack", b"note"]
