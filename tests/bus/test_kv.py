"""The KV bucket contract (both implementations): revisions, create, compare-and-set, delete, watch."""

from __future__ import annotations

import pytest

from bus import Bus, InvalidName, KeyConflict, KeyNotFound, KvChange
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
