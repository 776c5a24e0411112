"""A bad log file gets a clear error naming what is wrong (no traceback); corrupt entries are skipped only
when asked (``--skip-corrupt``), and reported with their position."""

from __future__ import annotations

import struct
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner, Result

from frontend.cli import cli
from scheduler.logfile import LogEntry, RecordedLog, write_log
from schemas import Codec, Subjects
from schemas.base import SCHEMA_VERSION
from schemas.envelope import Envelope
from schemas.requests import RequestArrived
from tests.scheduler.log_helpers import history

PREFIX = "logs"


def _log() -> RecordedLog:
    codec = Codec(producer="test")
    log = RecordedLog(PREFIX, [], [])
    for index, (subject, body) in enumerate(history(Subjects(PREFIX))):
        entries = log.loads if ".load." in subject else log.events
        entries.append(
            LogEntry(len(entries) + 1, 100.0 + index, subject, codec.encode(body, time=100.0 + index))
        )
    return log


def _written(tmp_path: Path, log: RecordedLog | None = None) -> Path:
    path = tmp_path / "cluster.log"
    write_log(path, log or _log())
    return path


def _entry_offsets(raw: bytes) -> list[int]:
    """Byte offsets of every entry's length prefix (the header first)."""
    offsets, offset = [], 0
    while offset < len(raw):
        offsets.append(offset)
        (size,) = struct.unpack_from(">I", raw, offset)
        offset += 4 + size
    return offsets[1:]


def _invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def _commands(path: Path, *extra: str) -> list[list[str]]:
    return [
        ["events", "list", "--file", str(path), "--json", *extra],
        ["replay", "--file", str(path), "--json", *extra],
        ["replay", "--file", str(path), "--request", "r1", "--json", *extra],
    ]


def _fails_cleanly(path: Path, message: str, *extra: str) -> None:
    for command in _commands(path, *extra):
        result = _invoke(*command)
        assert result.exit_code == 1, (command, result.output)
        assert message in result.output, (command, result.output)
        assert "Traceback" not in result.output and not isinstance(result.exception, (ValueError, KeyError))


def test_a_good_file_reads(tmp_path: Path) -> None:
    path = _written(tmp_path)
    for command in _commands(path, "--prefix", PREFIX):
        result = _invoke(*command)
        assert result.exit_code == 0, result.output


def test_truncated_inside_an_entry(tmp_path: Path) -> None:
    path = _written(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-7])
    last = _entry_offsets(raw)[-1]
    _fails_cleanly(path, f"is truncated: entry 16 (byte {last}) should be")


def test_truncated_at_an_entry_boundary(tmp_path: Path) -> None:
    path = _written(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[: _entry_offsets(raw)[-3]])
    _fails_cleanly(path, "is truncated: the header announces 17 entries, the file ends after 14")


def test_not_a_log_at_all(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello, these are not the droids\n")
    _fails_cleanly(path, "is not a shoal log")


def test_a_log_of_another_prefix(tmp_path: Path) -> None:
    path = _written(tmp_path)
    _fails_cleanly(
        path,
        f"is the log of prefix {PREFIX!r}, not 'other' (drop --prefix, or pass --prefix {PREFIX})",
        "--prefix",
        "other",
    )


def test_a_log_of_a_newer_schema_version(tmp_path: Path) -> None:
    path = _written(tmp_path)
    raw = path.read_bytes()
    (size,) = struct.unpack_from(">I", raw, 0)
    header = msgspec.msgpack.decode(raw[4 : 4 + size])
    header["schema_version"] = 99
    encoded = msgspec.msgpack.encode(header)
    path.write_bytes(struct.pack(">I", len(encoded)) + encoded + raw[4 + size :])
    expected = f"holds messages of schema version 99; this shoal reads up to version {SCHEMA_VERSION}"
    _fails_cleanly(path, expected)


def test_an_entry_of_another_schema_version_is_named(tmp_path: Path) -> None:
    log = _log()
    newer = Envelope(body=RequestArrived(request_id="r9", num_prompt_tokens=1, max_tokens=1), v=99)
    log.events.append(
        LogEntry(len(log.events) + 1, 200.0, f"{PREFIX}.ev.req.r9", Codec.encode_envelope(newer))
    )
    path = _written(tmp_path, log)
    _fails_cleanly(path, "schema version 99 at seq 16 on 'logs.ev.req.r9'")
    _fails_cleanly(path, "schema version 99", "--skip-corrupt")  # not corruption: never skipped


def test_an_entry_under_another_prefix_is_corrupt(tmp_path: Path) -> None:
    log = _log()
    stray = log.events[0]
    log.events.insert(1, LogEntry(2, stray.time, "elsewhere.ev.instance.i1", stray.data))
    path = _written(tmp_path, log)
    _fails_cleanly(path, "entry 1 (byte")
    _fails_cleanly(path, "is not under the log's prefix 'logs'")


@pytest.mark.parametrize("damage", ["payload", "entry"])
def test_a_corrupt_entry_is_reported_and_skipped_only_when_asked(tmp_path: Path, damage: str) -> None:
    log = _log()
    if damage == "payload":  # a stored message that is not an envelope
        log.events[4] = LogEntry(5, log.events[4].time, log.events[4].subject, b"\xc1\xc1garbage")
        path = _written(tmp_path, log)
    else:  # bytes of the file itself overwritten
        path = _written(tmp_path, log)
        raw = bytearray(path.read_bytes())
        offset = _entry_offsets(bytes(raw))[4]
        raw[offset + 4 : offset + 8] = b"\xc1\xc1\xc1\xc1"
        path.write_bytes(bytes(raw))
    offset = _entry_offsets(path.read_bytes())[4]
    _fails_cleanly(path, f"entry 4 (byte {offset}) is corrupt")
    _fails_cleanly(path, "pass --skip-corrupt to skip such entries")
    result = CliRunner().invoke(cli, ["events", "list", "--file", str(path), "--json", "--skip-corrupt"])
    assert result.exit_code == 0, result.output
    assert f"warning: skipped entry 4 (byte {offset}) of {path}" in result.stderr
    listed = [line for line in result.stdout.splitlines() if line]
    assert len(listed) == 14  # the 15 events less the corrupt one
    assert '"seq": 5' not in result.stdout
    result = CliRunner().invoke(
        cli, ["replay", "--file", str(path), "--skip-corrupt", "--request", "r2", "--json"]
    )
    assert result.exit_code == 0, result.output
