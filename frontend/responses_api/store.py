"""Stored responses (``store: true``), in a JetStream key-value bucket any frontend reads.

:class:`ResponseStore` keeps one :class:`StoredResponse` per response id in the bucket
``Subjects.responses_bucket`` (``<prefix>_responses``), opened through the bus
(:meth:`bus.protocol.Bus.kv_bucket`) on first use and created then if missing, with the
frontend's ``responses_ttl_s`` as its max age: a response can be retrieved or continued
(``previous_response_id``) for that long after it was made, by any frontend replica, and a
frontend restart loses none. A record holds the response object and the conversation items that
came before its output (earlier turns' items and its own input), so continuing a conversation
reads one record however long it is, and the conversation lives as long as its last response.

Values are msgspec JSON. A bus failure is a 503 in OpenAI's format
(:func:`~frontend.errors.unavailable`); every call is bounded by ``timeout_s``. A record that does
not decode is counted (``num_unreadable``), logged and answered as a 500, never a crash. An id
that is not of the form ``resp_<letters and digits>`` is unknown without a lookup.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable
from typing import Any, TypeVar

import msgspec

from bus import Bus, BusError, KvBucket
from frontend.errors import APIError, unavailable

__all__ = ["ResponseStore", "StoredResponse"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_ID = re.compile(r"resp_[A-Za-z0-9]{1,128}")


class StoredResponse(msgspec.Struct, frozen=True, kw_only=True):
    """One stored response: the object as the API returns it, and the items before its output."""

    response: dict[str, Any]
    #: earlier turns' input and output items, then this request's input (normalized)
    items: list[dict[str, Any]]
    #: where this request's own input starts in ``items``
    input_start: int = 0
    version: int = 1

    def input_items(self) -> list[dict[str, Any]]:
        """This request's own input items (``GET /v1/responses/{id}/input_items``)."""
        return self.items[self.input_start :]

    @property
    def response_id(self) -> str:
        return str(self.response["id"])

    def conversation(self) -> list[dict[str, Any]]:
        """What a response continuing this one starts from: its items, then its output."""
        return [*self.items, *self.response["output"]]


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(StoredResponse).decode


class ResponseStore:
    """Stored responses in the bucket ``name`` (entries kept ``ttl_s`` seconds)."""

    def __init__(
        self, bus: Bus, name: str, ttl_s: float, *, timeout_s: float = 10.0, retry_after_s: int = 1
    ) -> None:
        self.bus = bus
        self.name = name
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.num_unreadable = 0
        self._bucket: KvBucket | None = None
        self._opening = asyncio.Lock()

    async def _call(self, call: Awaitable[T], what: str) -> T:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await call
        except (BusError, TimeoutError) as exc:
            raise unavailable(
                f"the response store ({self.name}) cannot {what}: {exc}", self.retry_after_s
            ) from exc

    async def bucket(self) -> KvBucket:
        """The bucket, opened (and created if missing) on first use."""
        async with self._opening:
            if self._bucket is None:
                self._bucket = await self._call(self.bus.kv_bucket(self.name, max_age=self.ttl_s), "open")
            return self._bucket

    async def _value(self, response_id: str) -> bytes | None:
        if not _ID.fullmatch(response_id):
            return None
        bucket = await self.bucket()
        entry = await self._call(bucket.get(response_id), f"read {response_id}")
        return None if entry is None else entry.value

    async def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None if it was never stored, was deleted or expired."""
        value = await self._value(response_id)
        if value is None:
            return None
        try:
            return _decode(value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.num_unreadable += 1
            log.warning("stored response %s in %s does not decode: %s", response_id, self.name, exc)
            raise APIError(
                500,
                f"the stored response {response_id} cannot be read",
                type_="server_error",
                code="server_error",
            ) from exc

    async def put(self, stored: StoredResponse) -> None:
        bucket = await self.bucket()
        await self._call(bucket.put(stored.response_id, _encode(stored)), f"store {stored.response_id}")

    async def delete(self, response_id: str) -> bool:
        """Delete a stored response; False if there was none."""
        if await self._value(response_id) is None:
            return False
        bucket = await self.bucket()
        await self._call(bucket.delete(response_id), f"delete {response_id}")
        return True
