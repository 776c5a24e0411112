"""The agent's prefix-cache events: what its engine's cache gained and lost, on the bus.

:class:`CacheEventPublisher` is a step listener: after each engine step it takes the engine's
net cache delta (``Engine.take_cache_delta``, a few hashes) and queues it; nothing else happens
on the step path. Its own task (:meth:`CacheEventPublisher.run`) merges whatever is queued into
one :class:`~schemas.kv_events.KVCacheEvents` batch, numbers it (``seq`` 1, 2, 3, ... for this
process, whose ``incarnation`` is a fresh random id) and appends it to the ``<prefix>_kv``
stream, one append in flight at a time and at most one every ``min_interval_s``, so a busy
engine or a slow bus makes batches bigger, not more numerous, and never delays a step.

A batch is ``full`` (the engine's whole ``cached_block_hashes()``) when it is this process's
first, when the engine cleared its cache, when the scheduler asks with a ``KVCacheSync``
(:meth:`CacheEventPublisher.serve_sync`, a core NATS request) and every ``full_every_s`` (the
starting point of a replay of the bounded stream). An append that fails is retried with the same
message id, ``<incarnation>:<seq>`` (the stream drops a duplicate; one that got through anyway
is a repeat of its ``seq``, which the index ignores), and then given up: the scheduler sees the
gap in ``seq`` and asks for a full batch.

:class:`PendingBatch` is the pure merging of deltas; the engine is read only on the event loop's
thread (shoal's engines change their block tables there, between steps).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from agents.engines.block_manager import CacheDelta
from bus.errors import BusError
from bus.event_loop import wait_event
from schemas.envelope import Codec
from schemas.kv_events import KVCacheEvents, KVCacheSync, KVCacheSyncAck

__all__ = ["CacheEventPublisher", "CacheEventsConfig", "CacheSource", "PendingBatch"]

log = logging.getLogger(__name__)


class CacheSource(Protocol):
    """What the publisher reads of an engine (the ``Engine`` protocol has both)."""

    def take_cache_delta(self) -> CacheDelta: ...

    def cached_block_hashes(self) -> list[int]: ...


@dataclass(frozen=True)
class CacheEventsConfig:
    #: a full batch at least this often (the kv stream's retention then always holds one)
    full_every_s: float = 300.0
    #: how long one append may wait for the stream's acknowledgement, and how often it is tried
    append_timeout_s: float = 2.0
    append_attempts: int = 3
    #: at most one batch per this many seconds: a step's changes wait at most this long and
    #: batches merge meanwhile (``python -m agents.bench_cache_events``: the bytes it saves)
    min_interval_s: float = 0.1
    #: after a batch was given up, how long the next one waits
    failure_pause_s: float = 5.0

    def __post_init__(self) -> None:
        if self.full_every_s <= 0 or self.append_timeout_s <= 0 or self.append_attempts < 1:
            raise ValueError("full_every_s and append_timeout_s must be positive, append_attempts >= 1")
        if self.min_interval_s < 0 or self.failure_pause_s < 0:
            raise ValueError("min_interval_s and failure_pause_s must be >= 0")


class PendingBatch:
    """Deltas merged in order: a hash stored then removed is neither; a full set restarts it."""

    __slots__ = ("_present", "full")

    def __init__(self) -> None:
        self._present: dict[int, bool] = {}
        self.full = False

    def __bool__(self) -> bool:
        return self.full or bool(self._present)

    def add(self, stored: Iterable[int], removed: Iterable[int]) -> None:
        present = self._present
        for block_hash in removed:
            if self.full:
                present.pop(block_hash, None)
            else:
                present[block_hash] = False
        for block_hash in stored:
            present[block_hash] = True

    def replace(self, hashes: Iterable[int]) -> None:
        """Everything cached now (the deltas before it are moot)."""
        self._present = dict.fromkeys(hashes, True)
        self.full = True

    def take(self) -> tuple[bool, tuple[int, ...], tuple[int, ...]]:
        """``(full, stored, removed)``, and start empty."""
        present, full = self._present, self.full
        self._present, self.full = {}, False
        stored = tuple(h for h, here in present.items() if here)
        removed = () if full else tuple(h for h, here in present.items() if not here)
        return full, stored, removed


class CacheEventPublisher:
    """See the module docstring; ``append(subject, data, msg_id, timeout)`` stores one message."""

    def __init__(
        self,
        engine: CacheSource,
        *,
        instance_id: str,
        block_size: int,
        subject: str,
        append: Callable[[str, bytes, str, float], Awaitable[object]],
        codec: Codec,
        config: CacheEventsConfig | None = None,
        incarnation: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.instance_id = instance_id
        self.block_size = block_size
        self.subject = subject
        self.config = config or CacheEventsConfig()
        #: 48 random bits: unique among the processes an instance id ever had
        self.incarnation = incarnation or uuid.uuid4().hex[:12]
        self._append = append
        self._codec = codec
        self._clock = clock
        self._pending = PendingBatch()
        self._ready = asyncio.Event()
        self._full_at = float("-inf")
        #: the last ``seq`` handed to an append (0: none yet)
        self.seq = 0
        self.num_published = 0
        self.num_failed = 0
        self.num_syncs = 0
        self.bytes_published = 0
        self._failing_since: float | None = None
        self.request_full()  # the first batch is full

    # -- the step path ---------------------------------------------------------------------
    def after_step(self, _result: object = None) -> None:
        """A step listener: queue what the cache gained and lost in the step."""
        delta = self.engine.take_cache_delta()
        if delta.cleared:
            self._pending.replace(delta.stored)
        elif delta:
            self._pending.add(delta.stored, delta.removed)
        else:
            return
        self._ready.set()

    def request_full(self) -> None:
        """The next batch is the whole cache (taken now: the deltas so far are in it)."""
        self.engine.take_cache_delta()
        self._pending.replace(self.engine.cached_block_hashes())
        self._full_at = self._clock()
        self._ready.set()

    # -- the bus ---------------------------------------------------------------------------
    async def serve_sync(self, data: bytes, headers: dict[str, str]) -> bytes:
        """``KVCacheSync`` handler: answer at once; the full batch follows ``seq``."""
        envelope = self._codec.decode_or_none(data)
        body = None if envelope is None else envelope.body
        if not isinstance(body, KVCacheSync) or body.instance_id != self.instance_id:
            log.warning("agent %s: ignoring a malformed cache re-sync request", self.instance_id)
        else:
            self.num_syncs += 1
            log.info("agent %s: full cache batch asked for (%s)", self.instance_id, body.reason)
            self.request_full()
        reply = KVCacheSyncAck(instance_id=self.instance_id, incarnation=self.incarnation, seq=self.seq)
        return self._codec.encode(reply, time=time.time())

    def take_batch(self) -> KVCacheEvents | None:
        """The next batch to publish (numbered), or None when nothing is queued."""
        if self._clock() - self._full_at >= self.config.full_every_s:
            self.request_full()
        if not self._pending:
            return None
        full, stored, removed = self._pending.take()
        self.seq += 1
        return KVCacheEvents(
            instance_id=self.instance_id,
            incarnation=self.incarnation,
            seq=self.seq,
            block_size=self.block_size,
            stored=stored,
            removed=removed,
            full=full,
        )

    async def run(self) -> None:
        """Publish batches until cancelled (one append in flight), a full one every ``full_every_s``."""
        while True:
            await wait_event(self._ready, self.config.full_every_s)
            self._ready.clear()
            batch = self.take_batch()
            if batch is None:
                continue
            started = self._clock()
            await self.publish(batch)
            if (rest := self.config.min_interval_s - (self._clock() - started)) > 0:
                await asyncio.sleep(rest)

    async def publish(self, batch: KVCacheEvents) -> bool:
        """Store ``batch``, trying ``append_attempts`` times; after a batch is given up the next
        waits ``failure_pause_s`` (a stream that is missing or has no leader), and only the first
        failure of a run of them is logged as a warning."""
        data = self._codec.encode(batch, time=time.time())
        msg_id = f"{self.incarnation}:{batch.seq}"
        for attempt in range(1, self.config.append_attempts + 1):
            try:
                await self._append(self.subject, data, msg_id, self.config.append_timeout_s)
            except BusError as exc:
                level = logging.WARNING if self._failing_since is None else logging.DEBUG
                log.log(
                    level,
                    "agent %s: cache batch %d not stored (try %d of %d): %s",
                    self.instance_id,
                    batch.seq,
                    attempt,
                    self.config.append_attempts,
                    exc,
                )
                continue
            if self._failing_since is not None:
                log.info("agent %s: cache batches stored again", self.instance_id)
                self._failing_since = None
            self.num_published += 1
            self.bytes_published += len(data)
            return True
        if self._failing_since is None:
            self._failing_since = self._clock()
        await asyncio.sleep(self.config.failure_pause_s)
        self.num_failed += 1  # the scheduler sees the gap in seq and asks for a full batch
        return False
