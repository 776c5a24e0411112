"""The KV bucket contract (both implementations): revisions, create, compare-and-set, delete, watch."""

from __future__ import annotations

import pytest

from bus import (
    Bus,
    BusConfig,
    InvalidName,
    JetStreamBus,
    KeyConflict,
    KeyNotFound,
    KvChange,
    MemoryBroker,
    MemoryBus,
)
from schemas import Subjects
from tests.bus.conftest import MakeBus
from tests.bus.helpers import take


async def test_put_get_create_and_compare_and_set(bus: Bus) -> None:
    key = "sched.lease"
    assert await bus.kv_get(key) is None

    created = await bus.kv_create(key, b"scheduler-a")
    with pytest.raises(KeyConflict):
        await bus.kv_create(key, b"scheduler-b")
    assert await bus.kv_get(key) == (b"scheduler-a", created)

    updated = await bus.kv_update(key, b"scheduler-a/2", last_revision=created)
    assert updated > created
    with pytest.raises(KeyConflict) as stale:  # another writer got there first
        await bus.kv_update(key, b"scheduler-b", last_revision=created)
    assert not isinstance(stale.value, KeyNotFound)
    value, revision = await bus.kv_get(key) or (b"", 0)
    assert (value, revision) == (b"scheduler-a/2", updated)

    put = await bus.kv_put(key, b"forced")
    assert put > updated
    assert await bus.kv_get(key) == (b"forced", put)


async def test_revisions_are_shared_by_the_bucket(bus: Bus) -> None:
    first = await bus.kv_put("a", b"1")
    second = await bus.kv_put("b", b"1")
    third = await bus.kv_put("a", b"2")
    assert first < second < third


async def test_delete_then_create_again_and_cas_on_a_missing_key(bus: Bus) -> None:
    await bus.kv_put("snapshot.latest", b"v1")
    await bus.kv_delete("snapshot.latest")
    assert await bus.kv_get("snapshot.latest") is None
    with pytest.raises(KeyNotFound):
        await bus.kv_update("snapshot.latest", b"v2", last_revision=1)
    with pytest.raises(KeyNotFound):
        await bus.kv_update("never.written", b"v", last_revision=7)
    again = await bus.kv_create("snapshot.latest", b"v3")
    assert await bus.kv_get("snapshot.latest") == (b"v3", again)
    await bus.kv_delete("never.written")  # deleting a missing key is not an error


async def test_invalid_keys_are_rejected(bus: Bus) -> None:
    for key in ("", "has space", ".leading", "trailing.", "wild.*"):
        with pytest.raises(InvalidName):
            await bus.kv_put(key, b"x")


async def test_watch_starts_with_current_values_then_follows_changes(bus: Bus) -> None:
    await bus.kv_put("lease.a", b"a1")
    await bus.kv_put("lease.b", b"b1")
    await bus.kv_put("lease.gone", b"x")
    await bus.kv_delete("lease.gone")
    await bus.kv_put("other.c", b"c1")

    async with bus.kv_watch("lease.*") as watch:
        initial = await take(watch, 2)
        assert [(c.key, c.value) for c in initial] == [("lease.a", b"a1"), ("lease.b", b"b1")]
        revision = await bus.kv_put("lease.a", b"a2")
        await bus.kv_put("other.c", b"c2")  # not watched
        await bus.kv_delete("lease.b")
        changes = await take(watch, 2)
    assert changes[0] == KvChange("lease.a", b"a2", revision)
    assert changes[1].key == "lease.b" and changes[1].deleted and changes[1].revision > revision


async def test_watch_of_an_empty_pattern_sees_only_later_writes(bus: Bus) -> None:
    async with bus.kv_watch("instances.>") as watch:
        revision = await bus.kv_put("instances.i1.state", b"running")
        assert await take(watch, 1) == [KvChange("instances.i1.state", b"running", revision)]


async def test_a_named_bucket_is_shared_and_forgets_deleted_keys(
    make_bus: MakeBus, subjects: Subjects
) -> None:
    first, second = await make_bus(), await make_bus()
    name = subjects.responses_bucket
    bucket = await first.kv_bucket(name, max_age=3600.0)
    assert (bucket.name, bucket.max_age) == (name, 3600.0)
    revision = await bucket.put("resp_1", b"stored")
    assert await first.kv_get("resp_1") is None  # not the bus's own bucket
    again = await second.kv_bucket(name, max_age=3600.0)  # another process: the same bucket, found
    assert await again.get("resp_1") == (b"stored", revision)
    assert await again.get("resp_never") is None
    await again.delete("resp_1")
    assert await bucket.get("resp_1") is None
    with pytest.raises(InvalidName):
        await bucket.get("has space")


async def test_a_named_bucket_takes_the_max_age_it_is_opened_with(
    make_bus: MakeBus, subjects: Subjects
) -> None:
    bus = await make_bus()
    name = subjects.responses_bucket
    await bus.kv_bucket(name, max_age=3600.0)
    bucket = await bus.kv_bucket(name, max_age=120.0)
    assert bucket.max_age == 120.0
    if isinstance(bus, JetStreamBus):
        info = await bus.client.jsm().stream_info(f"KV_{name}")
        assert info.config.max_age == pytest.approx(120.0)
    with pytest.raises(ValueError):
        await bus.kv_bucket(name, max_age=0.0)


async def test_an_entry_of_a_named_bucket_expires_after_max_age(subjects: Subjects) -> None:
    now = [1000.0]
    bus = MemoryBus(BusConfig(subjects=subjects), broker=MemoryBroker(clock=lambda: now[0]))
    await bus.connect()
    bucket = await bus.kv_bucket(subjects.responses_bucket, max_age=60.0)
    await bucket.put("resp_1", b"v")
    now[0] += 59.0
    assert await bucket.get("resp_1") is not None
    now[0] += 2.0
    assert await bucket.get("resp_1") is None
