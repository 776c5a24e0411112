"""``shoal events``: list, follow and export the cluster's event log.

``shoal events list`` prints the entries an :class:`~scheduler.event_query.EventQuery`
selects, from the live streams (``--nats``, ``--prefix``) or an exported file
(``--file``), as a table or JSON lines (``--json``); ``--follow`` (or
``shoal events follow``) keeps printing new entries as they are stored.
Filters that name a subject (request, migration, instance, message type) are
applied by the server. ``shoal events export`` writes both streams to a file
for ``shoal replay --file``. ``shoal events prefix-index`` rebuilds the
scheduler's prefix index from the kv stream as of a sequence or of a request's
dispatch. A bad log file is an error naming what is wrong,
not a traceback. What to select lives in :mod:`scheduler.event_query`; the
file format in :mod:`scheduler.logfile`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click
import msgspec
from rich.console import Console
from rich.table import Table

from bus import BusConfig, BusError, JetStreamBus, StreamNotFound, event_loop
from bus.auth import NatsAuth, redact_url
from bus.event_loop import cancel_and_wait
from bus.options import nats_auth_options, nats_option, pop_nats_auth
from bus.protocol import StoredMessage
from scheduler.event_query import EventMatcher, EventQuery, StreamFilter, parse_time
from scheduler.history import HISTORY_MARGIN_S, HistoryCorrupt, checkpoint_before
from scheduler.logfile import LogEntry, LogFileError, RecordedLog, load_log, read_bus_log, write_log
from scheduler.prefix_index import PrefixIndex
from scheduler.replay import prefix_hits_text, prefix_index_at
from schemas import Subjects
from schemas.decisions import Dispatched
from schemas.envelope import Codec, Envelope
from schemas.errors import MalformedMessage

__all__ = ["EventRow", "events", "read_live", "read_log_file", "run_live", "time_option"]

T = TypeVar("T")

DEFAULT_PREFIX = "shoal"


class EventRow(msgspec.Struct, frozen=True):
    """One listed entry: where it is stored, when, and what it says."""

    stream: str
    seq: int
    time: float
    subject: str
    type: str
    producer: str
    event_time: float
    body: dict[str, Any]


def time_option(value: str | None) -> float | None:
    """A ``--since``/``--until`` value as epoch seconds; a bad one is a usage error."""
    try:
        return parse_time(value, now=time.time())
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def read_log_file(path: Path, prefix: str | None, *, skip_corrupt: bool = False) -> RecordedLog:
    """:func:`load_log` with its errors as a clean command-line error (no traceback)."""
    try:
        log = load_log(path, prefix=prefix, skip_corrupt=skip_corrupt)
    except LogFileError as exc:
        raise click.ClickException(str(exc)) from None
    for skipped in log.skipped:
        click.echo(f"warning: skipped {skipped}", err=True)
    return log


def run_live(main: Coroutine[Any, Any, T], nats_url: str, prefix: str) -> T:
    """Run ``main`` against the live streams; bus errors become a clean command-line error."""
    try:
        return event_loop.run(main)
    except StreamNotFound as exc:
        raise click.ClickException(f"no log for prefix {prefix!r} at {redact_url(nats_url)}: {exc}") from None
    except BusError as exc:
        raise click.ClickException(f"cannot read the log at {redact_url(nats_url)}: {exc}") from None


def _bus_config(nats_url: str, prefix: str, auth: NatsAuth | None = None) -> BusConfig:
    return BusConfig(
        url=nats_url, auth=auth or NatsAuth(), subjects=Subjects(prefix), name="shoal-events", provision=False
    )


async def read_live(
    nats_url: str,
    prefix: str,
    since: float | None,
    until: float | None,
    auth: NatsAuth | None = None,
    *,
    skip_corrupt: bool = False,
    replay_from: float | None = None,
) -> RecordedLog:
    """The log of the cluster at ``nats_url`` (entries stored within [since, until]; with
    ``replay_from``, from the last checkpoint before that time on, what a replay of it needs); a
    corrupt history entry is a clean error, or with ``skip_corrupt`` a warning."""
    async with JetStreamBus(_bus_config(nats_url, prefix, auth)) as bus:
        if replay_from is not None and since is None:
            checkpoint = await checkpoint_before(bus, replay_from)
            if checkpoint is not None:
                since = checkpoint.taken_at - HISTORY_MARGIN_S
        try:
            log = await read_bus_log(bus, since=since, until=until, skip_corrupt=skip_corrupt)
        except HistoryCorrupt as exc:
            raise click.ClickException(str(exc)) from None
    for skipped in log.skipped:
        click.echo(f"warning: skipped {skipped}", err=True)
    return log


def read_any(
    path: Path | None,
    prefix: str | None,
    nats_url: str,
    *,
    auth: NatsAuth | None = None,
    skip_corrupt: bool = False,
    replay_from: float | None = None,
) -> RecordedLog:
    """The log file at ``path`` if given (its prefix checked against ``prefix``), else the live log
    of ``prefix`` (default ``shoal``) at ``nats_url`` (from the checkpoint before ``replay_from``
    if given); problems are clean command-line errors."""
    if path is not None:
        return read_log_file(path, prefix, skip_corrupt=skip_corrupt)
    name = prefix or DEFAULT_PREFIX
    live = read_live(nats_url, name, None, None, auth, skip_corrupt=skip_corrupt, replay_from=replay_from)
    return run_live(live, nats_url, name)


def read_from_options(options: dict[str, Any]) -> RecordedLog:
    """:func:`read_any` for a command that takes ``--file``/``--prefix``/``--nats``/``--skip-corrupt`` and
    the raw NATS auth options (popped from ``options``): ``shoal replay --simulate``."""
    auth = pop_nats_auth(options)
    path, prefix, url = options["path"], options["prefix"], options["nats_url"]
    return read_any(path, prefix, url, auth=auth, skip_corrupt=options["skip_corrupt"])


def _entry(message: StoredMessage) -> LogEntry:
    return LogEntry(message.position.seq, message.time, message.subject, message.data)


def _summary_value(value: Any) -> Any:
    if isinstance(value, list) and len(value) > 8:
        return f"[{len(value)} items]"
    return value


def _row(codec: Codec, stream: str, entry: LogEntry) -> tuple[EventRow, Envelope | None]:
    try:
        envelope = codec.decode(entry.data)
    except MalformedMessage as exc:
        row = EventRow(
            stream,
            entry.seq,
            entry.time,
            entry.subject,
            f"undecodable ({exc.kind})",
            "",
            0.0,
            {"error": str(exc)},
        )
        return row, None
    body = msgspec.to_builtins(envelope.body)
    kind = body.pop("type", type(envelope.body).__name__)
    if isinstance(envelope.body, Dispatched) and envelope.body.cached_blocks:
        body["cached_blocks"] = dict(envelope.body.cached_blocks)  # instance -> leading blocks held
    row = EventRow(
        stream,
        entry.seq,
        entry.time,
        entry.subject,
        kind,
        envelope.producer,
        envelope.time,
        {k: _summary_value(v) for k, v in body.items()},
    )
    return row, envelope


def select(
    stream_entries: list[tuple[str, list[LogEntry]]], query: EventQuery, matcher: EventMatcher
) -> Iterator[EventRow]:
    """Rows of the entries ``matcher`` keeps, events stream first then loads, each in order."""
    codec = Codec()
    for stream, entries in stream_entries:
        for entry in entries:
            row, envelope = _row(codec, stream, entry)
            if envelope is None:
                if not query.types and not query.request_id and not query.migration_id:
                    yield row
                continue
            if matcher(entry.subject, entry.time, envelope.body):
                yield row


def _iso(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat(timespec="milliseconds")


def _fields(body: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in body.items() if v not in ("", None, [], (), {}))


class _Printer:
    def __init__(self, as_json: bool, table: bool) -> None:
        self.as_json = as_json
        # piped output (a file, a pager, a test) gets wide rows rather than folded ones
        self.console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
        self.table: Table | None = None
        if table and not as_json:
            self.table = Table(title="events")
            for column in ("seq", "stored at", "subject", "type", "producer"):
                self.table.add_column(column, no_wrap=True)
            self.table.add_column("fields", overflow="fold", min_width=20)
        self.count = 0

    def __call__(self, row: EventRow) -> None:
        self.count += 1
        if self.as_json:
            click.echo(json.dumps(msgspec.to_builtins(row)))
            return
        cells = (
            str(row.seq),
            _iso(row.time),
            row.subject,
            row.type,
            row.producer,
            _fields(row.body),
        )
        if self.table is not None:
            self.table.add_row(*cells)
        else:
            self.console.print(" ".join(cells), markup=False, highlight=False)

    def close(self) -> None:
        if self.table is not None:
            self.console.print(self.table)
            self.console.print(f"{self.count} entries")


async def _list_live(
    nats_url: str,
    prefix: str,
    query: EventQuery,
    emit: Callable[[EventRow], None],
    *,
    follow: bool,
    limit: int | None,
    flush: Callable[[], None],
    auth: NatsAuth | None = None,
) -> None:
    subjects = Subjects(prefix)
    filters = query.server_filters(subjects)
    if not query.wants_loads():
        filters = [f for f in filters if f.stream != subjects.loads_stream]
    matcher = EventMatcher(query)
    async with JetStreamBus(_bus_config(nats_url, prefix, auth)) as bus:
        last: dict[str, int] = {}
        batches: list[tuple[str, list[LogEntry]]] = []
        for stream_filter in filters:
            last[stream_filter.stream] = await bus.last_seq(stream_filter.stream)
            entries: list[LogEntry] = []
            if last[stream_filter.stream] > 0:
                feed = bus.replay(
                    stream_filter.stream,
                    until_seq=last[stream_filter.stream],
                    subjects=stream_filter.subjects or None,
                )
                async with feed:
                    async for message in feed:
                        entries.append(_entry(message))
            batches.append((stream_filter.stream, entries))
        count = 0
        for row in select(batches, query, matcher):
            emit(row)
            count += 1
            if limit is not None and count >= limit:
                flush()
                return
        flush()
        if follow:
            await _follow(bus, filters, last, query, matcher, emit, None if limit is None else limit - count)


async def _follow(
    bus: JetStreamBus,
    filters: list[StreamFilter],
    last: dict[str, int],
    query: EventQuery,
    matcher: EventMatcher,
    emit: Callable[[EventRow], None],
    limit: int | None,
) -> None:
    """Print new entries of every stream as they are stored, from just after ``last``."""
    queue: asyncio.Queue[tuple[str, LogEntry]] = asyncio.Queue()

    async def tail(stream_filter: StreamFilter) -> None:
        feed = bus.tail(
            stream_filter.stream,
            from_seq=last[stream_filter.stream] + 1,
            subjects=stream_filter.subjects or None,
        )
        async with feed:
            async for message in feed:
                await queue.put((stream_filter.stream, _entry(message)))

    tasks = [asyncio.ensure_future(tail(f)) for f in filters]
    try:
        count = 0
        while limit is None or count < limit:
            stream, entry = await queue.get()
            for row in select([(stream, [entry])], query, matcher):
                emit(row)
                count += 1
    finally:
        await cancel_and_wait(tasks)


def _source_options(command: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        nats_option(),
        nats_auth_options,
        click.option(
            "--prefix",
            default=None,
            help=f"Subject prefix (default {DEFAULT_PREFIX}; with --file: checked against the file's).",
        ),
        click.option(
            "--file",
            "path",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            default=None,
            help="Read an exported log file instead of the live streams.",
        ),
        click.option("--skip-corrupt", is_flag=True, help="Skip (and report) corrupt entries of --file."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _filter_options(command: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option(
            "--type",
            "types",
            multiple=True,
            help="Message type: its tag (dispatched) or class name (Dispatched); repeatable.",
        ),
        click.option("--instance", "instance_id", default=None, help="Events naming this instance."),
        click.option("--request", "request_id", default=None, help="This request's events and migrations."),
        click.option("--migration", "migration_id", default=None, help="This migration's handshake."),
        click.option(
            "--since", default=None, help="Stored at or after: ISO 8601, epoch seconds or an age (10m)."
        ),
        click.option("--until", default=None, help="Stored at or before (same forms)."),
        click.option("--subject", default=None, help="Subject pattern with NATS wildcards (shoal.ev.mig.>)."),
        click.option("--loads", "include_loads", is_flag=True, help="Also list load reports."),
        click.option("--limit", type=int, default=None, help="Stop after this many entries."),
        click.option("--json", "as_json", is_flag=True, help="JSON lines instead of a table."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _run_list(o: dict[str, Any], follow: bool) -> None:
    query = EventQuery(
        types=frozenset(o["types"]),
        instance_id=o["instance_id"],
        request_id=o["request_id"],
        migration_id=o["migration_id"],
        since=time_option(o["since"]),
        until=time_option(o["until"]),
        subject=o["subject"],
        include_loads=o["include_loads"],
    )
    try:
        query.classes()
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--type") from None
    printer = _Printer(o["as_json"], table=not follow)
    if o["path"] is not None:
        if follow:
            raise click.UsageError("--follow reads the live streams; it cannot follow a --file")
        log = read_log_file(o["path"], o["prefix"], skip_corrupt=o["skip_corrupt"])
        batches = [(log.subjects.events_stream, log.events)]
        if query.wants_loads():
            batches.append((log.subjects.loads_stream, log.loads))
        for count, row in enumerate(select(batches, query, EventMatcher(query)), 1):
            printer(row)
            if o["limit"] is not None and count >= o["limit"]:
                break
        printer.close()
        return
    prefix = o["prefix"] or DEFAULT_PREFIX
    try:
        run_live(
            _list_live(
                o["nats_url"], prefix, query, printer, follow=follow, limit=o["limit"], flush=printer.close,
                auth=o["nats_auth"],
            ),
            o["nats_url"],
            prefix,
        )
    except KeyboardInterrupt:
        pass


@click.group("events")
def events() -> None:
    """The event log: list, follow or export it."""


@events.command("list")
@_source_options
@_filter_options
@click.option("--follow", is_flag=True, help="Keep printing entries as they are stored (live streams only).")
def list_events(**o: Any) -> None:
    """List log entries, filtered by type, instance, request, migration, time or subject."""
    _run_list(o, follow=o["follow"])


@events.command("follow")
@_source_options
@_filter_options
def follow_events(**o: Any) -> None:
    """Print log entries as they are stored (``list --follow``)."""
    _run_list(o, follow=True)


@events.command("export")
@nats_option()
@nats_auth_options
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True)
@click.option("--out", "path", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.option(
    "--since", default=None, help="Only entries stored at or after (ISO 8601, epoch seconds or 10m)."
)
@click.option("--until", default=None, help="Only entries stored at or before.")
def export(
    nats_url: str, nats_auth: NatsAuth, prefix: str, path: Path, since: str | None, until: str | None
) -> None:
    """Write the events and loads streams (or a time window of them) to a file for ``shoal replay --file``."""
    reading = read_live(nats_url, prefix, time_option(since), time_option(until), nats_auth)
    log = run_live(reading, nats_url, prefix)
    count = write_log(path, log)
    click.echo(f"wrote {count} entries ({len(log.events)} events, {len(log.loads)} load reports) to {path}")


async def _prefix_index_live(
    nats_url: str, prefix: str, auth: NatsAuth | None, kv_seq: int | None, request_id: str | None
) -> tuple[PrefixIndex, Dispatched | None]:
    codec = Codec()
    async with JetStreamBus(_bus_config(nats_url, prefix, auth)) as bus:
        subjects = bus.config.subjects
        decision: Dispatched | None = None
        if request_id is not None:
            async with bus.replay(subjects.events_stream, subjects=[subjects.sched("dispatch")]) as feed:
                async for message in feed:
                    envelope = codec.decode_or_none(message.data)
                    if envelope is not None and isinstance(envelope.body, Dispatched):
                        if envelope.body.request_id == request_id:
                            decision = envelope.body  # the last: a requeue or a rescue comes later
            if decision is None:
                raise click.ClickException(f"no dispatch of request {request_id!r} in the events stream")
            kv_seq = decision.kv_seq
        entries: list[tuple[int, Any]] = []
        if await bus.last_seq(subjects.kv_stream):
            async with bus.replay(subjects.kv_stream, until_seq=kv_seq or None) as kv_feed:
                async for message in kv_feed:
                    envelope = codec.decode_or_none(message.data)
                    entries.append((message.position.seq, None if envelope is None else envelope.body))
    return prefix_index_at(entries, through_seq=kv_seq or None), decision


@events.command("prefix-index")
@nats_option()
@nats_auth_options
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True)
@click.option("--kv-seq", type=int, default=None, help="As of this kv-stream sequence (default: its end).")
@click.option(
    "--request", "request_id", default=None,
    help="As of this request's dispatch, with the blocks each instance held then.",
)
@click.option("--json", "as_json", is_flag=True, help="JSON instead of text.")
def prefix_index(
    nats_url: str, nats_auth: NatsAuth, prefix: str, kv_seq: int | None, request_id: str | None, as_json: bool
) -> None:
    """The scheduler's prefix index rebuilt from the kv stream: per instance its cached blocks."""
    if kv_seq is not None and request_id is not None:
        raise click.UsageError("give --kv-seq or --request, not both")
    reading = _prefix_index_live(nats_url, prefix, nats_auth, kv_seq, request_id)
    index, decision = run_live(reading, nats_url, prefix)
    snapshot = index.snapshot()
    rows = [
        {"instance_id": e.instance_id, "incarnation": e.incarnation, "seq": e.seq, "block_size": e.block_size,
         "cached_blocks": len(e.hashes), "stale": e.stale}
        for e in snapshot.instances
    ]
    if as_json:
        out: dict[str, Any] = {"kv_seq": index.kv_seq, "instances": rows, "malformed": index.num_malformed}
        if decision is not None:
            out["dispatch"] = msgspec.to_builtins(decision)
        click.echo(json.dumps(out))
        return
    click.echo(f"kv stream seq {index.kv_seq}: {len(rows)} instances, {index.num_hashes} distinct blocks"
               + (f", {index.num_malformed} malformed entries" if index.num_malformed else ""))
    for row in rows:
        stale = "  (stale)" if row["stale"] else ""
        click.echo(f"  {row['instance_id']}  incarnation {row['incarnation']} seq {row['seq']}  "
                   f"{row['cached_blocks']} blocks of {row['block_size']}{stale}")
    if decision is not None:
        click.echo(prefix_hits_text(decision))
