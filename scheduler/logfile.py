"""A recorded log: the streams read from the bus or from an exported file.

:class:`RecordedLog` keeps the raw entries of the events and loads streams
(sequence, server time, subject, payload, message id) so a replay decodes and
folds exactly what the scheduler saw. Read from the bus, the loads stream is
completed by the history stream's archive (``scheduler.history``: the loads
stream itself keeps seconds) and the history's checkpoints come along.
``shoal events export`` writes one with :func:`write_log`; ``shoal replay
--file`` reads it with :func:`load_log`. The file is a msgpack header
followed by length-prefixed msgpack entries.
:func:`load_log` checks what it reads and raises :class:`LogFileError` naming
the problem: not a log, a newer format or schema version, a truncated file, a
log of another prefix, or a corrupt entry (with its position; skipped and
listed in ``RecordedLog.skipped`` only with ``skip_corrupt``).
"""

from __future__ import annotations

import struct
from pathlib import Path

import msgspec

from bus.protocol import MSG_ID_HEADER, Bus
from scheduler.history import LogEntry, merge_loads, read_history
from schemas.base import SCHEMA_VERSION
from schemas.envelope import Codec
from schemas.errors import MalformedMessage, UnsupportedVersion
from schemas.subjects import Subjects

__all__ = ["LogEntry", "LogFileError", "RecordedLog", "load_log", "read_bus_log", "write_log"]

FORMAT = "shoal-log"
#: 2: checkpoint entries (the history stream's state checkpoints) after the loads.
VERSION = 2


class LogFileError(ValueError):
    """A log file that cannot be read as asked; the message says what is wrong and where."""


class _Header(msgspec.Struct, frozen=True):
    format: str
    version: int
    prefix: str
    num_events: int
    num_loads: int
    #: The newest message schema version of the writer (0: written before this was recorded).
    schema_version: int = 0
    num_checkpoints: int = 0


class _Tagged(msgspec.Struct, array_like=True, frozen=True, gc=False):
    loads: bool
    entry: LogEntry
    checkpoint: bool = False


class RecordedLog(msgspec.Struct):
    prefix: str
    events: list[LogEntry]
    loads: list[LogEntry]
    #: Corrupt entries :func:`load_log` skipped, described with their position.
    skipped: list[str] = msgspec.field(default_factory=list)
    #: The history stream's checkpoints (``schemas.history.Checkpoint`` entries), oldest first.
    checkpoints: list[LogEntry] = msgspec.field(default_factory=list)

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    def window(self, since: float | None, until: float | None) -> RecordedLog:
        def keep(entry: LogEntry) -> bool:
            return (since is None or entry.time >= since) and (until is None or entry.time <= until)

        return RecordedLog(
            self.prefix,
            [e for e in self.events if keep(e)],
            [e for e in self.loads if keep(e)],
            checkpoints=list(self.checkpoints),
        )


async def _read_stream(
    bus: Bus, stream: str, since: float | None = None, until: float | None = None
) -> list[LogEntry]:
    """The stream's entries, from the first stored at ``since`` (found by the server) to the last
    stored at ``until``."""
    entries: list[LogEntry] = []
    if await bus.last_seq(stream) == 0:
        return entries
    start = 1 if since is None else await bus.seq_at_time(stream, since)
    if start is None:
        return entries
    async with bus.replay(stream, from_seq=start) as feed:
        async for message in feed:
            if until is not None and message.time > until:
                break
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


async def read_bus_log(
    bus: Bus, *, since: float | None = None, until: float | None = None, skip_corrupt: bool = False
) -> RecordedLog:
    """The log as it is now (optionally only entries stored within [since, until]): the events
    stream, the loads stream completed by the history stream's archive, and its checkpoints.
    A corrupt history entry raises ``HistoryCorrupt`` (a ``ValueError`` naming its position), or
    with ``skip_corrupt`` is left out and described in ``skipped``."""
    subjects = bus.config.subjects
    skipped: list[str] = []
    archived, checkpoints = await read_history(
        bus, since=since, until=until, skipped=skipped if skip_corrupt else None
    )
    log = RecordedLog(
        subjects.prefix,
        await _read_stream(bus, subjects.events_stream, since, until),
        merge_loads(await _read_stream(bus, subjects.loads_stream, since, until), archived),
        skipped=skipped,
        checkpoints=checkpoints,
    )
    if since is None and until is None:
        return log
    windowed = log.window(since, until)
    windowed.skipped = skipped
    return windowed


_encoder = msgspec.msgpack.Encoder()


def write_log(path: Path, log: RecordedLog) -> int:
    """Write ``log`` to ``path``; returns the number of entries."""
    with path.open("wb") as out:
        header = _encoder.encode(
            _Header(
                FORMAT,
                VERSION,
                log.prefix,
                len(log.events),
                len(log.loads),
                SCHEMA_VERSION,
                len(log.checkpoints),
            )
        )
        out.write(struct.pack(">I", len(header)) + header)
        for is_loads, entries in ((False, log.events), (True, log.loads)):
            for entry in entries:
                data = _encoder.encode(_Tagged(is_loads, entry))
                out.write(struct.pack(">I", len(data)) + data)
        for entry in log.checkpoints:
            data = _encoder.encode(_Tagged(False, entry, checkpoint=True))
            out.write(struct.pack(">I", len(data)) + data)
    return len(log.events) + len(log.loads) + len(log.checkpoints)


def _header(path: Path, raw: bytes) -> tuple[_Header, int]:
    if len(raw) < 4:
        raise LogFileError(f"{path} is not a shoal log: {len(raw)} bytes, too short for a header")
    (size,) = struct.unpack_from(">I", raw, 0)
    if size > len(raw) - 4:
        raise LogFileError(f"{path} is not a shoal log, or is truncated inside its header")
    try:
        header = msgspec.msgpack.decode(raw[4 : 4 + size], type=_Header)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise LogFileError(f"{path} is not a shoal log (no shoal-log header)") from None
    if header.format != FORMAT:
        raise LogFileError(f"{path} is not a shoal log (format {header.format!r})")
    if header.version > VERSION:
        raise LogFileError(
            f"{path} is a shoal log of file format v{header.version}; this shoal reads up to v{VERSION}"
        )
    if header.schema_version > SCHEMA_VERSION:
        raise LogFileError(
            f"{path} holds messages of schema version {header.schema_version}; this shoal reads up to "
            f"version {SCHEMA_VERSION} (upgrade shoal to read it)"
        )
    return header, 4 + size


def _check_prefix(path: Path, header: _Header, prefix: str | None) -> None:
    if prefix is not None and prefix != header.prefix:
        raise LogFileError(
            f"{path} is the log of prefix {header.prefix!r}, not {prefix!r} "
            f"(drop --prefix, or pass --prefix {header.prefix})"
        )


def load_log(path: Path, *, prefix: str | None = None, skip_corrupt: bool = False) -> RecordedLog:
    """Read a file written by :func:`write_log`, checking it (see the module docstring).

    ``prefix``, if given, must be the one the log was exported with. Every
    entry must be a stored message of that prefix whose envelope decodes; one
    that is not is an error naming its position, or with ``skip_corrupt`` is
    left out and described in ``RecordedLog.skipped``.
    """
    raw = path.read_bytes()
    header, offset = _header(path, raw)
    _check_prefix(path, header, prefix)
    decoder = msgspec.msgpack.Decoder(_Tagged)
    codec = Codec()
    log = RecordedLog(header.prefix, [], [])
    expected = header.num_events + header.num_loads + header.num_checkpoints
    index = 0
    while offset < len(raw):
        where = f"entry {index} (byte {offset})"
        if offset + 4 > len(raw):
            raise LogFileError(f"{path} is truncated: {where} has a partial length prefix")
        (size,) = struct.unpack_from(">I", raw, offset)
        if offset + 4 + size > len(raw):
            raise LogFileError(
                f"{path} is truncated: {where} should be {size} bytes, {len(raw) - offset - 4} remain "
                f"(the header announces {expected} entries)"
            )
        chunk = raw[offset + 4 : offset + 4 + size]
        offset += 4 + size
        index += 1
        problem = _problem(codec, decoder, chunk, header.prefix)
        if isinstance(problem, _Tagged):
            target = log.checkpoints if problem.checkpoint else log.loads if problem.loads else log.events
            target.append(problem.entry)
            continue
        if problem.startswith("schema"):
            raise LogFileError(f"{path}: {where} {problem}")
        if not skip_corrupt:
            raise LogFileError(
                f"{path}: {where} is corrupt: {problem}; pass --skip-corrupt to skip such entries"
            )
        log.skipped.append(f"{where} of {path}: {problem}")
    if index < expected:
        raise LogFileError(
            f"{path} is truncated: the header announces {expected} entries, the file ends after {index}"
        )
    return log


def _problem(
    codec: Codec, decoder: msgspec.msgpack.Decoder[_Tagged], chunk: bytes, prefix: str
) -> _Tagged | str:
    """The entry in ``chunk``, or what is wrong with it (``schema ...`` for another schema version)."""
    try:
        tagged = decoder.decode(chunk)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return f"not a log entry ({exc})"
    entry = tagged.entry
    where = f"seq {entry.seq} on {entry.subject!r}"
    if not entry.subject.startswith(prefix + "."):
        return f"{where} is not under the log's prefix {prefix!r}"
    try:
        codec.decode(entry.data)
    except UnsupportedVersion as exc:
        return f"schema version {exc.version} at {where}: {exc}"
    except MalformedMessage as exc:
        return f"{where} does not decode ({exc.kind}: {exc})"
    return tagged
