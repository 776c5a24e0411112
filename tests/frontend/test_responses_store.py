"""The stored responses on the in-memory bus: a round trip, expiry after the TTL, an unreachable bus
as a 503, a record that does not decode as a 500 (counted), ids that cannot be ours as unknown."""

from __future__ import annotations

import pytest

from bus import BusConfig, MemoryBroker, MemoryBus
from frontend.errors import APIError
from frontend.responses_api.store import ResponseStore, StoredResponse
from schemas import Subjects

SUBJECTS = Subjects("t")


def _stored(response_id: str = "resp_1") -> StoredResponse:
    user = {"id": "msg_1", "type": "message", "role": "user", "status": "completed", "content": []}
    answer = {"id": "msg_2", "type": "message", "role": "assistant", "status": "completed", "content": []}
    return StoredResponse(response={"id": response_id, "output": [answer]}, items=[user])


async def _store(now: list[float]) -> tuple[MemoryBus, ResponseStore]:
    bus = MemoryBus(BusConfig(subjects=SUBJECTS), broker=MemoryBroker(clock=lambda: now[0]))
    await bus.connect()
    return bus, ResponseStore(bus, SUBJECTS.responses_bucket, 60.0)


async def test_a_stored_response_is_read_back_with_its_conversation_until_it_expires() -> None:
    now = [1000.0]
    _, store = await _store(now)
    await store.put(_stored())
    found = await store.get("resp_1")
    assert found is not None and [item["id"] for item in found.conversation()] == ["msg_1", "msg_2"]
    now[0] += 61.0
    assert await store.get("resp_1") is None


async def test_delete_says_whether_there_was_one_and_foreign_ids_are_unknown() -> None:
    _, store = await _store([0.0])
    await store.put(_stored())
    assert await store.delete("resp_1") and not await store.delete("resp_1")
    for foreign in ("chatcmpl-1", "resp_", "resp_a.b", "resp_*"):
        assert await store.get(foreign) is None


async def test_an_unreachable_bus_is_a_503_and_a_record_that_does_not_decode_a_500() -> None:
    bus, store = await _store([0.0])
    bucket = await store.bucket()
    await bucket.put("resp_bad", b"not json")
    with pytest.raises(APIError) as unreadable:
        await store.get("resp_bad")
    assert unreadable.value.status == 500 and store.num_unreadable == 1
    await bus.close()
    with pytest.raises(APIError) as down:
        await store.get("resp_1")
    assert down.value.status == 503 and down.value.headers["Retry-After"] == "1"
