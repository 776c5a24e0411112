"""Long retention: the load-report archive and the state checkpoints of the history stream.

The loads stream stays short (about 100 reports per instance: what a
recovering scheduler must read). What a replay of an older instant needs is
kept in the history stream (``schemas.history``) instead:

* :class:`LoadArchiver` (run by the active scheduler) copies every loads-stream
  entry it has read, byte for byte with its sequence, server time and message
  id, into compressed :class:`~schemas.history.ArchivedLoads` batches every
  ``interval_s``. On taking over it resumes after the last archived sequence,
  reading from the loads stream what it has not seen itself, so a crash loses
  nothing the loads stream still held. Repeats are harmless: readers keep
  the first copy of each sequence.
* :func:`checkpoint_message` packs the folded state at a fold point into a
  :class:`~schemas.history.Checkpoint` (appended every few minutes), so a replay
  starts from the last checkpoint before the instant it rebuilds.

:func:`read_history` reads the stream back as loads-stream entries and
checkpoints. Packing and unpacking are pure; the archiver and the reader are
the I/O shells.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable

import msgspec

from bus.errors import BusError
from bus.protocol import MSG_ID_HEADER, Bus, StoredMessage
from scheduler.cluster_state import ClusterState, decode_snapshot, encode_snapshot
from scheduler.recompute import Cursor
from schemas.envelope import Codec
from schemas.history import ArchivedLoads, Checkpoint

__all__ = [
    "ARCHIVE_BATCH",
    "HISTORY_MARGIN_S",
    "HistoryCorrupt",
    "LoadArchiver",
    "LogEntry",
    "checkpoint_before",
    "checkpoint_message",
    "checkpoint_state",
    "merge_loads",
    "pack_loads",
    "read_history",
    "unpack_loads",
]

log = logging.getLogger(__name__)

#: Archive batches are read from this long before a window (a batch is stored after its reports).
HISTORY_MARGIN_S = 60.0
#: Most entries in one ``ArchivedLoads`` message (about 40 KB compressed; NATS allows 1 MB).
ARCHIVE_BATCH = 4096
_ZLIB_LEVEL = 6


class LogEntry(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A stored message as read from a stream: sequence, server time, subject, payload, message id."""

    seq: int
    time: float
    subject: str
    data: bytes
    msg_id: str = ""


_entries = msgspec.msgpack.Decoder(list[LogEntry])
_encoder = msgspec.msgpack.Encoder()


def pack_loads(entries: list[LogEntry]) -> ArchivedLoads:
    """One archive batch of ``entries`` (consecutive loads-stream entries, in order)."""
    if not entries:
        raise ValueError("an archive batch needs at least one entry")
    data = zlib.compress(_encoder.encode(entries), _ZLIB_LEVEL)
    return ArchivedLoads(
        first_seq=entries[0].seq, last_seq=entries[-1].seq, num_entries=len(entries), data=data
    )


def unpack_loads(batch: ArchivedLoads) -> list[LogEntry]:
    """The entries of a batch; ``ValueError`` if it does not unpack."""
    if batch.encoding != "zlib+msgpack":
        raise ValueError(
            f"archive batch {batch.first_seq}..{batch.last_seq}: unknown encoding {batch.encoding!r}"
        )
    try:
        entries = _entries.decode(zlib.decompress(batch.data))
    except (zlib.error, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"archive batch {batch.first_seq}..{batch.last_seq} is corrupt: {exc}") from exc
    if len(entries) != batch.num_entries:
        raise ValueError(
            f"archive batch {batch.first_seq}..{batch.last_seq} holds {len(entries)} entries, "
            f"announces {batch.num_entries}"
        )
    return entries


def checkpoint_message(
    state: ClusterState, cursor: Cursor, *, epoch: int, taken_at: float, policy: str
) -> Checkpoint:
    return Checkpoint(
        epoch=epoch,
        events_seq=cursor.events_seq,
        loads_seq=cursor.loads_seq,
        taken_at=taken_at,
        state=zlib.compress(encode_snapshot(state), _ZLIB_LEVEL),
        policy=policy,
    )


def checkpoint_state(checkpoint: Checkpoint) -> ClusterState:
    """The state a checkpoint holds; ``ValueError`` if it does not decode."""
    try:
        return decode_snapshot(zlib.decompress(checkpoint.state))
    except (zlib.error, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"checkpoint at events seq {checkpoint.events_seq} is corrupt: {exc}") from exc


def decode_checkpoint(codec: Codec, entry: LogEntry) -> Checkpoint | None:
    envelope = codec.decode_or_none(entry.data)
    return envelope.body if envelope is not None and isinstance(envelope.body, Checkpoint) else None


def entry_of(message: StoredMessage) -> LogEntry:
    return LogEntry(
        message.position.seq,
        message.time,
        message.subject,
        message.data,
        message.headers.get(MSG_ID_HEADER, ""),
    )


class LoadArchiver:
    """Copies the loads stream into the history stream (see the module docstring).

    The service calls :meth:`offer` with every loads-stream message it reads (in
    any role) and runs :meth:`run` while it is the active scheduler.
    """

    def __init__(
        self,
        bus: Bus,
        *,
        interval_s: float = 1.0,
        max_buffered: int = 20_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bus = bus
        self.subjects = bus.config.subjects
        self.codec = Codec(producer="scheduler-archive")
        self.interval_s = interval_s
        self._buffer: deque[LogEntry] = deque(maxlen=max_buffered)
        self._clock = clock
        #: The last loads sequence known to be in the history stream (-1: not looked up yet).
        self.archived_through = -1
        self.num_batches = 0
        self.num_archived = 0
        self.num_bytes = 0

    def offer(self, message: StoredMessage) -> None:
        if message.position.seq > self.archived_through:
            self._buffer.append(entry_of(message))

    async def resume(self) -> None:
        """Find where the archive ends and archive what the loads stream still holds after it."""
        self.archived_through = await self._last_archived()
        await self._fill_gap()

    async def _fill_gap(self) -> None:
        """Read from the loads stream what lies between the archive's end and the buffer's start
        (what this process did not see, or dropped from a full buffer)."""
        first_buffered = self._buffer[0].seq if self._buffer else None
        if first_buffered is not None and first_buffered <= self.archived_through + 1:
            return
        last = await self.bus.last_seq(self.subjects.loads_stream)
        until = last if first_buffered is None else first_buffered - 1
        if until <= self.archived_through:
            return
        missed: list[LogEntry] = []
        async with self.bus.replay(
            self.subjects.loads_stream, from_seq=self.archived_through + 1, until_seq=until
        ) as feed:
            async for message in feed:
                missed.append(entry_of(message))
        self._buffer.extendleft(reversed(missed))

    async def _last_archived(self) -> int:
        stream = self.subjects.history_stream
        last = await self.bus.last_seq(stream)
        # the newest archive batch is near the end (checkpoints are rare): look back a little
        start = max(1, last - 16)
        found = 0
        if last == 0:
            return 0
        async with self.bus.replay(
            stream, from_seq=start, until_seq=last, subjects=[self.subjects.history("loads")]
        ) as feed:
            async for message in feed:
                envelope = self.codec.decode_or_none(message.data)
                if envelope is not None and isinstance(envelope.body, ArchivedLoads):
                    found = max(found, envelope.body.last_seq)
        return found

    async def flush(self) -> int:
        """Append what is buffered beyond the archive's end; returns the entries archived."""
        if self.archived_through < 0:
            return 0
        while self._buffer and self._buffer[0].seq <= self.archived_through:
            self._buffer.popleft()
        await self._fill_gap()  # after an overflow of the buffer, or what the feed had not offered
        done = 0
        while self._buffer:
            batch = [self._buffer.popleft() for _ in range(min(ARCHIVE_BATCH, len(self._buffer)))]
            message = pack_loads(batch)
            data = self.codec.encode(message, time=time.time())
            try:
                await self.bus.append(
                    self.subjects.history("loads"),
                    data,
                    msg_id=f"archive:{message.first_seq}:{message.last_seq}",
                )
            except BusError:
                self._buffer.extendleft(reversed(batch))
                raise
            self.archived_through = message.last_seq
            self.num_batches += 1
            self.num_archived += len(batch)
            self.num_bytes += len(data)
            done += len(batch)
        return done

    async def run(self) -> None:
        """Resume, then flush every ``interval_s`` until cancelled; bus errors are retried."""
        while True:
            try:
                if self.archived_through < 0:
                    await self.resume()
                await self.flush()
            except BusError as exc:
                log.warning("archiving load reports failed (will retry): %s", exc)
            await asyncio.sleep(self.interval_s)


class HistoryCorrupt(ValueError):
    """An entry of the history stream does not decode; the message names its position."""


async def read_history(
    bus: Bus, *, since: float | None = None, until: float | None = None, skipped: list[str] | None = None
) -> tuple[list[LogEntry], list[LogEntry]]:
    """The archived loads-stream entries (by sequence, first copy of each, optionally only those
    stored within [since, until]) and the history stream's checkpoint entries (all of them).

    An entry that does not decode raises :class:`HistoryCorrupt`, or, given a ``skipped`` list,
    is described there and left out."""
    subjects = bus.config.subjects
    stream = subjects.history_stream
    codec = Codec()
    loads: dict[int, LogEntry] = {}
    checkpoints: list[LogEntry] = []
    if await bus.last_seq(stream) == 0:
        return [], []
    # every checkpoint (a replay starts from one before its window), and the archive batches stored
    # from a margin before ``since`` (a batch holds reports up to its interval older than itself)
    start = 1 if since is None else await bus.seq_at_time(stream, since - HISTORY_MARGIN_S)
    reads: list[tuple[int, float | None, list[str]]] = [(1, None, [subjects.history("checkpoint")])]
    if start is not None:
        last = None if until is None else until + HISTORY_MARGIN_S
        reads.append((start, last, [subjects.history("loads")]))
    for from_seq, last, wanted in reads:
        async with bus.replay(stream, from_seq=from_seq, subjects=wanted) as feed:
            async for message in feed:
                if last is not None and message.time > last:
                    break
                _read_history_entry(codec, message, since, until, loads, checkpoints, skipped)
    return [loads[seq] for seq in sorted(loads)], checkpoints


def _read_history_entry(
    codec: Codec,
    message: StoredMessage,
    since: float | None,
    until: float | None,
    loads: dict[int, LogEntry],
    checkpoints: list[LogEntry],
    skipped: list[str] | None,
) -> None:
    where = f"history stream {message.position.stream} seq {message.position.seq} ({message.subject})"
    envelope = codec.decode_or_none(message.data)
    body = None if envelope is None else envelope.body
    try:
        if not isinstance(body, (ArchivedLoads, Checkpoint)):
            raise ValueError("not an archive batch or a checkpoint")
        if isinstance(body, Checkpoint):
            checkpoint_state(body)  # fails here, named, rather than in a replay
            checkpoints.append(entry_of(message))
            return
        unpacked = unpack_loads(body)
    except ValueError as exc:
        if skipped is None:
            raise HistoryCorrupt(f"{where} is corrupt: {exc}; pass --skip-corrupt to skip it") from None
        skipped.append(f"{where}: {exc}")
        return
    for entry in unpacked:
        if (since is None or entry.time >= since) and (until is None or entry.time <= until):
            loads.setdefault(entry.seq, entry)


async def checkpoint_before(bus: Bus, at: float) -> Checkpoint | None:
    """The latest checkpoint taken at or before ``at`` (reads the checkpoint subject only)."""
    subjects = bus.config.subjects
    if await bus.last_seq(subjects.history_stream) == 0:
        return None
    codec = Codec()
    best: Checkpoint | None = None
    async with bus.replay(subjects.history_stream, subjects=[subjects.history("checkpoint")]) as feed:
        async for message in feed:
            envelope = codec.decode_or_none(message.data)
            body = None if envelope is None else envelope.body
            if isinstance(body, Checkpoint) and body.taken_at <= at:
                best = body
    return best


def merge_loads(*sources: Iterable[LogEntry]) -> list[LogEntry]:
    """Entries of several copies of the loads stream, by sequence, first copy of each."""
    merged: dict[int, LogEntry] = {}
    for source in sources:
        for entry in source:
            merged.setdefault(entry.seq, entry)
    return [merged[seq] for seq in sorted(merged)]
