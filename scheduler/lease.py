"""The scheduler lease: one active scheduler, fenced by an epoch, in a NATS KV key.

The lease is the KV key ``scheduler.lease`` holding a :class:`LeaseRecord`
(holder id, epoch, time-to-live). The holder renews it every ``ttl / 3`` by a
compare-and-set on the key's revision; a failed renewal means it was taken
over and the holder must stop deciding at once. A contender judges expiry by
its *own* monotonic clock: a lease whose revision has not changed for ``ttl``
seconds is expired (no trust in other hosts' clocks). Taking it over is a
compare-and-set too, with the epoch raised above every epoch known (the
lease's and the log's), so two contenders cannot both win. A clean stop
releases the lease so a standby takes over without waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from bus.errors import KeyConflict
from bus.protocol import Bus

__all__ = ["LEASE_KEY", "Lease", "LeaseLost", "LeaseRecord"]

LEASE_KEY = "scheduler.lease"


class LeaseRecord(msgspec.Struct, frozen=True, kw_only=True):
    holder: str
    epoch: int
    ttl_s: float
    released: bool = False


class LeaseLost(Exception):
    """The lease was taken over (or could not be renewed in time)."""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(LeaseRecord).decode


@dataclass
class _Observed:
    revision: int
    since: float


class Lease:
    """Acquire, renew and release the scheduler lease for ``holder``."""

    def __init__(
        self, bus: Bus, *, holder: str, ttl_s: float = 3.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.bus = bus
        self.holder = holder
        self.ttl_s = ttl_s
        self._clock = clock
        self._revision: int | None = None
        self._observed: _Observed | None = None
        self.epoch = 0
        self.renewed_at = 0.0
        #: calls of :meth:`try_acquire` (each reads the lease from the KV store)
        self.attempts = 0

    @property
    def held(self) -> bool:
        return self._revision is not None

    async def current(self) -> tuple[LeaseRecord | None, int]:
        entry = await self.bus.kv_get(LEASE_KEY)
        if entry is None or not entry.value:
            return None, 0 if entry is None else entry.revision
        try:
            return _decode(entry.value), entry.revision
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None, entry.revision

    async def try_acquire(self, *, min_epoch: int = 0) -> bool:
        """One attempt: take the lease if it is free, released or expired. True on success."""
        self.attempts += 1
        record, revision = await self.current()
        now = self._clock()
        if record is not None and not record.released and record.holder != self.holder:
            if self._observed is None or self._observed.revision != revision:
                self._observed = _Observed(revision, now)
                return False
            if now - self._observed.since < record.ttl_s:
                return False
        epoch = max(min_epoch, 0 if record is None else record.epoch) + 1
        value = _encode(LeaseRecord(holder=self.holder, epoch=epoch, ttl_s=self.ttl_s))
        try:
            if revision == 0:
                new_revision = await self.bus.kv_create(LEASE_KEY, value)
            else:
                new_revision = await self.bus.kv_update(LEASE_KEY, value, last_revision=revision)
        except KeyConflict:
            self._observed = None
            return False
        self._revision = new_revision
        self.epoch = epoch
        self.renewed_at = now
        return True

    async def renew(self) -> None:
        """Extend the lease; raises :class:`LeaseLost` if someone else changed it."""
        if self._revision is None:
            raise LeaseLost("lease not held")
        value = _encode(LeaseRecord(holder=self.holder, epoch=self.epoch, ttl_s=self.ttl_s))
        try:
            self._revision = await self.bus.kv_update(LEASE_KEY, value, last_revision=self._revision)
        except KeyConflict as exc:
            self._revision = None
            raise LeaseLost(f"lease epoch {self.epoch} was taken over") from exc
        self.renewed_at = self._clock()

    def expired_locally(self) -> bool:
        """True if no renewal succeeded for a whole ttl (stop deciding: a standby may have taken over)."""
        return self._revision is None or self._clock() - self.renewed_at >= self.ttl_s

    async def release(self) -> None:
        if self._revision is None:
            return
        value = _encode(LeaseRecord(holder=self.holder, epoch=self.epoch, ttl_s=self.ttl_s, released=True))
        try:
            await self.bus.kv_update(LEASE_KEY, value, last_revision=self._revision)
        except KeyConflict:
            pass
        self._revision = None
