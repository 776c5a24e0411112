"""A recorded log: both streams read from the bus or from an exported file.

:class:`RecordedLog` keeps the raw entries of the events and loads streams
(sequence, server time, subject, payload, message id) so a replay decodes and
folds exactly what the scheduler saw. ``shoal events export`` writes one with
:func:`write_log`; ``shoal replay --file`` reads it with :func:`load_log`.
The file is a msgpack header followed by length-prefixed msgpack entries.
"""

from __future__ import annotations

import struct
from pathlib import Path

import msgspec

from bus.protocol import MSG_ID_HEADER, Bus
from schemas.subjects import Subjects

__all__ = ["LogEntry", "RecordedLog", "load_log", "read_bus_log", "write_log"]

FORMAT = "shoal-log"
VERSION = 1


class LogEntry(msgspec.Struct, array_like=True, frozen=True, gc=False):
    seq: int
    time: float
    subject: str
    data: bytes
    msg_id: str = ""


class _Header(msgspec.Struct, frozen=True):
    format: str
    version: int
    prefix: str
    num_events: int
    num_loads: int


class _Tagged(msgspec.Struct, array_like=True, frozen=True, gc=False):
    loads: bool
    entry: LogEntry


class RecordedLog(msgspec.Struct):
    prefix: str
    events: list[LogEntry]
    loads: list[LogEntry]

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    def window(self, since: float | None, until: float | None) -> RecordedLog:
        def keep(entry: LogEntry) -> bool:
            return (since is None or entry.time >= since) and (until is None or entry.time <= until)

        return RecordedLog(
            self.prefix, [e for e in self.events if keep(e)], [e for e in self.loads if keep(e)]
        )


async def _read_stream(bus: Bus, stream: str) -> list[LogEntry]:
    entries: list[LogEntry] = []
    if await bus.last_seq(stream) == 0:
        return entries
    async with bus.replay(stream) as feed:
        async for message in feed:
            entries.append(
                LogEntry(
                    message.position.seq,
                    message.time,
                    message.subject,
                    message.data,
                    message.headers.get(MSG_ID_HEADER, ""),
                )
            )
    return entries


async def read_bus_log(bus: Bus, *, since: float | None = None, until: float | None = None) -> RecordedLog:
    """Both streams as they are now (optionally only entries stored within [since, until])."""
    subjects = bus.config.subjects
    log = RecordedLog(
        subjects.prefix,
        await _read_stream(bus, subjects.events_stream),
        await _read_stream(bus, subjects.loads_stream),
    )
    return log if since is None and until is None else log.window(since, until)


_encoder = msgspec.msgpack.Encoder()


def write_log(path: Path, log: RecordedLog) -> int:
    """Write ``log`` to ``path``; returns the number of entries."""
    with path.open("wb") as out:
        header = _encoder.encode(_Header(FORMAT, VERSION, log.prefix, len(log.events), len(log.loads)))
        out.write(struct.pack(">I", len(header)) + header)
        for is_loads, entries in ((False, log.events), (True, log.loads)):
            for entry in entries:
                data = _encoder.encode(_Tagged(is_loads, entry))
                out.write(struct.pack(">I", len(data)) + data)
    return len(log.events) + len(log.loads)


def load_log(path: Path) -> RecordedLog:
    raw = path.read_bytes()
    offset = 0

    def take() -> bytes:
        nonlocal offset
        (size,) = struct.unpack_from(">I", raw, offset)
        offset += 4
        chunk = raw[offset : offset + size]
        offset += size
        return chunk

    header = msgspec.msgpack.decode(take(), type=_Header)
    if header.format != FORMAT or header.version > VERSION:
        raise ValueError(f"{path} is not a shoal log (format {header.format!r} v{header.version})")
    decoder = msgspec.msgpack.Decoder(_Tagged)
    log = RecordedLog(header.prefix, [], [])
    while offset < len(raw):
        tagged = decoder.decode(take())
        (log.loads if tagged.loads else log.events).append(tagged.entry)
    return log
