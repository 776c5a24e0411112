"""What the drill sees on the bus while it runs: migrations, instance events, the scheduler's epoch.

:class:`BusWatch` connects straight to NATS (not through the chaos proxy),
follows ``<prefix>.ev.>`` as core messages (the events stream stores the same
messages; the verdicts read the stored log afterwards) and keeps what the
faults need to pick and verify their targets: migrations in flight with their
source and destination, instances that report terminating or left, the latest
lease epoch and when the last dispatch decision was seen, and each
instance's lifecycle as it happened (joined, failed, left: when each
instance was ready). It also asks an agent for its usage now (the agent's
``stats`` RPC).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bus import BusConfig, BusError, JetStreamBus
from bus.event_loop import cancel_and_wait
from schemas import Codec, Subjects
from schemas.decisions import Dispatched
from schemas.instance import InstanceFailed, InstanceJoined, InstanceLeft, InstanceTerminating
from schemas.load import LoadReport
from schemas.migration import Abort, CommitAck, PreAllocate
from schemas.rpc import MigrateOut

__all__ = ["BusWatch", "MigrationSeen"]

log = logging.getLogger(__name__)


@dataclass
class MigrationSeen:
    migration_id: str
    request_id: str
    source_id: str
    destination_id: str
    started_at: float
    stage: int = 0
    outcome: str | None = None


@dataclass
class BusWatch:
    nats_url: str
    prefix: str
    clock: Callable[[], float] = time.monotonic
    migrations: dict[str, MigrationSeen] = field(default_factory=dict)
    terminating: dict[str, float] = field(default_factory=dict)
    left: dict[str, float] = field(default_factory=dict)
    joined: dict[str, float] = field(default_factory=dict)
    dispatches: list[tuple[float, int]] = field(default_factory=list)
    #: (drill time, instance id, ``joined`` | ``failed`` | ``left``) in the order seen
    lifecycle: list[tuple[float, str, str]] = field(default_factory=list)
    epoch: int = 0
    _bus: JetStreamBus | None = None
    _task: asyncio.Task[None] | None = None
    _codec: Codec = field(default_factory=lambda: Codec(producer="shoal-drill"))

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    @property
    def bus(self) -> JetStreamBus:
        if self._bus is None:
            raise RuntimeError("the watch is not started")
        return self._bus

    async def start(self) -> None:
        self._bus = JetStreamBus(
            BusConfig(
                url=self.nats_url,
                subjects=self.subjects,
                name="shoal-drill",
                provision=False,
                connect_attempts=20,
            )
        )
        await self._bus.connect()
        subscription = await self._bus.subscribe(f"{self.prefix}.ev.>")
        self._task = asyncio.ensure_future(self._follow(subscription))

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
        if self._bus is not None:
            with contextlib.suppress(Exception):
                await self._bus.close()

    async def _follow(self, subscription: object) -> None:
        async for message in subscription:  # type: ignore[attr-defined]
            envelope = self._codec.decode_or_none(message.data)
            if envelope is not None:
                self._see(envelope.body)

    def _see(self, body: object) -> None:
        now = self.clock()
        if isinstance(body, PreAllocate):
            seen = self.migrations.get(body.migration_id)
            if seen is None:
                self.migrations[body.migration_id] = MigrationSeen(
                    body.migration_id, body.request_id, body.source_id, body.destination_id, now, body.stage
                )
            else:
                seen.stage = max(seen.stage, body.stage)
        elif isinstance(body, CommitAck | Abort):
            seen = self.migrations.get(body.migration_id)
            if seen is not None and seen.outcome is None:
                seen.outcome = "committed" if isinstance(body, CommitAck) else f"aborted: {body.reason}"
        elif isinstance(body, InstanceTerminating):
            self.terminating.setdefault(body.instance_id, now)
        elif isinstance(body, InstanceLeft):
            self.left[body.instance_id] = now
            self.lifecycle.append((now, body.instance_id, "left"))
        elif isinstance(body, InstanceJoined):
            self.joined[body.instance_id] = now
            self.lifecycle.append((now, body.instance_id, "joined"))
        elif isinstance(body, InstanceFailed):
            self.lifecycle.append((now, body.instance_id, "failed"))
        elif isinstance(body, Dispatched):
            self.epoch = max(self.epoch, body.epoch)
            self.dispatches.append((now, body.epoch))
        epoch = getattr(body, "epoch", None)
        if isinstance(epoch, int):
            self.epoch = max(self.epoch, epoch)

    async def seed_from_log(self) -> None:
        """Take the instances ready before the watch started from the stored log: each whose last
        lifecycle event there is ``InstanceJoined`` and that the watch has not seen since counts as
        joined now."""
        from scheduler.events_cli import read_live

        log_ = await read_live(self.nats_url, self.prefix, None, None)
        last: dict[str, str] = {}
        for entry in log_.events:
            envelope = self._codec.decode_or_none(entry.data)
            body = None if envelope is None else envelope.body
            if isinstance(body, InstanceJoined):
                last[body.instance_id] = "joined"
            elif isinstance(body, InstanceFailed | InstanceLeft):
                last[body.instance_id] = "gone"
        seen = {i for _, i, _ in self.lifecycle}
        now = self.clock()
        for instance_id, state in sorted(last.items()):
            if state == "joined" and instance_id not in seen:
                self.joined.setdefault(instance_id, now)
                self.lifecycle.insert(0, (now, instance_id, "joined"))

    def joined_since(self, instance_id: str, since: float) -> float | None:
        """When ``instance_id`` announced itself ready at or after ``since`` (None: not yet)."""
        joins = (t for t, i, kind in self.lifecycle if i == instance_id and kind == "joined" and t >= since)
        return next(joins, None)

    def in_flight(self) -> list[MigrationSeen]:
        return [m for m in self.migrations.values() if m.outcome is None]

    async def wait_for(self, condition: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> bool:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(step_s)
        return True

    # ------------------------------------------------------------------ RPCs to agents

    async def stats(self, instance_id: str, timeout_s: float = 2.0) -> LoadReport | None:
        """The agent's usage now (None: it did not answer)."""
        try:
            reply = await self.bus.request(
                self.subjects.rpc_agent(instance_id, "stats"), b"", timeout=timeout_s
            )
        except BusError:
            return None
        envelope = self._codec.decode_or_none(reply.data)
        return envelope.body if envelope is not None and isinstance(envelope.body, LoadReport) else None

    async def migrate_out(self, source_id: str, destination_id: str) -> bool:
        """Ask ``source_id`` to move its requests to ``destination_id`` (under the scheduler's epoch)."""
        command = MigrateOut(epoch=self.epoch, destination_id=destination_id, target_freeness=1e9)
        try:
            reply = await self.bus.request(
                self.subjects.rpc_agent(source_id, "migrate_out"),
                self._codec.encode(command, time=time.time()),
                timeout=3.0,
            )
        except BusError as exc:
            log.warning("migrate_out to %s failed: %s", source_id, exc)
            return False
        envelope = self._codec.decode_or_none(reply.data)
        return envelope is not None and bool(getattr(envelope.body, "accepted", False))
