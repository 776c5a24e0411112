"""The migration's record in the events stream, and the first-outcome-wins claim.

Every handshake message an agent sends is appended to
``<prefix>.ev.mig.<migration-id>`` in a :class:`~schemas.Envelope` stamped
with the agent's clock (:meth:`MigrationLog.record`, fire-and-forget so the
handshake never waits on the log). The outcome of a migration lives on its own
subject, ``<prefix>.ev.mig.<migration-id>.outcome``: :meth:`MigrationLog.claim`
appends the destination's ``CommitAck`` or the source's ``Abort`` there only
if the subject is still empty (JetStream's ``Nats-Expected-Last-Subject-Sequence:
0``) and answers with the outcome the log holds, so exactly one side owns the
request whatever got lost on the way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

from bus import AppendFailed, Bus, BusError
from schemas import Codec
from schemas.migration import Abort, CommitAck, MigrationMessage, MigrationStarted

__all__ = ["EXPECTED_LAST_SUBJECT_SEQ", "MigrationLog", "outcome_subject"]

log = logging.getLogger(__name__)

EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"


def outcome_subject(migration_subject: str) -> str:
    return f"{migration_subject}.outcome"


class MigrationLog:
    """Appends one agent's migration messages and claims outcomes."""

    def __init__(self, bus: Bus, codec: Codec, *, clock: Callable[[], float] = time.time) -> None:
        self._bus = bus
        self._codec = codec
        self._clock = clock
        self._counter = itertools.count()
        self._pending: set[asyncio.Task[None]] = set()
        self.num_failed_appends = 0

    def record(self, message: MigrationMessage | MigrationStarted, *, trace: str | None = None) -> None:
        """Append ``message`` to its migration's subject in the background."""
        subject = self._bus.config.subjects.mig(message.migration_id)
        data = self._codec.encode(message, time=self._clock(), trace=trace)
        msg_id = f"{self._codec.producer}:{message.migration_id}:{next(self._counter)}"
        task = asyncio.get_running_loop().create_task(self._append(subject, data, msg_id))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _append(self, subject: str, data: bytes, msg_id: str) -> None:
        try:
            await self._bus.append(subject, data, msg_id=msg_id)
        except BusError as exc:
            self.num_failed_appends += 1
            log.warning("migration log append to %s failed: %s", subject, exc)

    async def claim(self, outcome: CommitAck | Abort) -> bool:
        """Append ``outcome`` unless an outcome is already logged; True if the log says committed."""
        subject = outcome_subject(self._bus.config.subjects.mig(outcome.migration_id))
        data = self._codec.encode(outcome, time=self._clock())
        msg_id = f"{outcome.migration_id}:outcome:{self._codec.producer}"
        try:
            await self._bus.append(subject, data, msg_id=msg_id, headers={EXPECTED_LAST_SUBJECT_SEQ: "0"})
        except AppendFailed:
            pass  # an outcome is there already (or ours, stored by an earlier try): read it back
        else:
            return isinstance(outcome, CommitAck)
        return await self.read_outcome(outcome.migration_id)

    async def read_outcome(self, migration_id: str) -> bool:
        """Whether the first outcome logged for the migration is a commit; BusError if none is."""
        subject = outcome_subject(self._bus.config.subjects.mig(migration_id))
        stream = self._bus.config.subjects.events_stream
        async with self._bus.replay(stream, subjects=[subject]) as feed:
            async for stored in feed:
                envelope = self._codec.decode_or_none(stored.data)
                if envelope is not None and isinstance(envelope.body, CommitAck | Abort):
                    return isinstance(envelope.body, CommitAck)
        raise BusError(f"no outcome logged for migration {migration_id!r}")

    async def flush(self) -> None:
        """Wait for the background appends so far."""
        if self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    def cancel(self) -> None:
        for task in list(self._pending):
            task.cancel()
