"""What ``shoal events list`` selects: a filter over log entries and the subjects it maps to.

:class:`EventQuery` holds the filters a user gives (message type, instance,
request, migration, time window, subject pattern). :meth:`EventQuery.server_filters`
turns the most specific of them into subject filters the server applies (so a
request's events are read from ``<prefix>.ev.req.<id>`` and the dispatch
subject, not by scanning the stream); :class:`EventMatcher` then applies every
filter to each decoded entry. :func:`parse_time` reads ISO 8601 times, epoch
seconds and relative ages (``10m``). Pure: no I/O lives here.
"""

from __future__ import annotations

import datetime as dt
import re
import typing
from dataclasses import dataclass

from schemas.decisions import (
    DecisionEvent,
    Dispatched,
    Paired,
    ScaleDown,
    ScaleUp,
    SchedulerTick,
    Unpaired,
)
from schemas.envelope import Body
from schemas.instance import InstanceEvent
from schemas.load import LoadReport
from schemas.migration import Commit, CommitAck, MigrationMessage, PreAllocate
from schemas.requests import RequestEvent
from schemas.subjects import Subjects

__all__ = [
    "EventMatcher",
    "EventQuery",
    "StreamFilter",
    "message_types",
    "parse_time",
    "subject_matches",
    "type_name",
]

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

#: The scheduler's subject kind for each decision type (``<prefix>.ev.sched.<kind>``).
_SCHED_KIND: dict[type, str] = {
    Dispatched: "dispatch",
    Paired: "pair",
    Unpaired: "unpair",
    ScaleUp: "scale_up",
    ScaleDown: "scale_down",
    SchedulerTick: "tick",
}


def parse_time(value: str | None, *, now: float) -> float | None:
    """Epoch seconds from ``value``: epoch seconds, ISO 8601 (UTC if naive) or an age like ``10m``."""
    if value is None:
        return None
    text = value.strip()
    relative = _RELATIVE.match(text)
    if relative is not None:
        return now - float(relative.group(1)) * _UNITS[relative.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        parsed = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"{value!r} is not a time: give ISO 8601, epoch seconds or an age like 30s, 10m, 2h, 1d"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return parsed.timestamp()


def _family(union: object) -> tuple[type, ...]:
    return tuple(typing.get_args(union))


_FAMILIES: dict[str, tuple[type, ...]] = {
    "instance": _family(InstanceEvent),
    "sched": _family(DecisionEvent),
    "mig": _family(MigrationMessage),
    "req": _family(RequestEvent),
    "load": (LoadReport,),
}


def type_name(cls: type) -> str:
    """The wire tag of a message class (``Dispatched`` → ``dispatched``)."""
    tag = cls.__struct_config__.tag  # type: ignore[attr-defined]
    return str(tag) if tag is not None else cls.__name__


def message_types() -> dict[str, type]:
    """Every logged message type by tag and by lower-case class name."""
    found: dict[str, type] = {}
    for family in _FAMILIES.values():
        for cls in family:
            found[type_name(cls)] = cls
            found[cls.__name__.lower()] = cls
    return found


def _subject_for(cls: type, subjects: Subjects) -> tuple[str, str]:
    """(stream, subject filter) where messages of ``cls`` are stored."""
    if cls is LoadReport:
        return subjects.loads_stream, subjects.loads_all
    if cls in _SCHED_KIND:
        return subjects.events_stream, subjects.sched(_SCHED_KIND[cls])
    if cls in _FAMILIES["instance"]:
        return subjects.events_stream, f"{subjects.prefix}.ev.instance.*"
    if cls in _FAMILIES["req"]:
        return subjects.events_stream, f"{subjects.prefix}.ev.req.*"
    return subjects.events_stream, f"{subjects.prefix}.ev.mig.>"


class StreamFilter(typing.NamedTuple):
    """One stream to read and the subject filters the server applies ([]: the whole stream)."""

    stream: str
    subjects: list[str]


@dataclass(frozen=True)
class EventQuery:
    """The filters of one listing; each given filter must hold (they combine with AND)."""

    types: frozenset[str] = frozenset()
    instance_id: str | None = None
    request_id: str | None = None
    migration_id: str | None = None
    since: float | None = None
    until: float | None = None
    subject: str | None = None
    #: Also list load reports (the loads stream); implied by ``--type load_report``.
    include_loads: bool = False

    def classes(self) -> tuple[type, ...]:
        """The message classes asked for (empty: all). Raises ValueError naming an unknown type."""
        known = message_types()
        unknown = sorted(t for t in self.types if t.lower() not in known)
        if unknown:
            raise ValueError(f"unknown event type(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return tuple(dict.fromkeys(known[t.lower()] for t in sorted(self.types, key=str.lower)))

    def wants_loads(self) -> bool:
        if self.subject is not None:
            return ".load." in f".{self.subject}"
        classes = self.classes()
        if classes:
            return LoadReport in classes
        if self.request_id or self.migration_id:
            return False
        return self.include_loads

    def server_filters(self, subjects: Subjects) -> list[StreamFilter]:
        """The streams to read and their subject filters, from the most specific filter given."""
        events = subjects.events_stream
        prefix = subjects.prefix
        found: list[StreamFilter] = []
        if self.subject is not None:
            stream = subjects.loads_stream if self.subject.startswith(f"{prefix}.load.") else events
            return [StreamFilter(stream, [self.subject])]
        if self.migration_id is not None:
            mig = subjects.mig(self.migration_id)
            return [StreamFilter(events, [mig, f"{mig}.outcome"])]
        if self.request_id is not None:
            # the request's own events, the dispatch decisions and the handshakes (matched by body)
            return [
                StreamFilter(
                    events, [subjects.req(self.request_id), subjects.sched("dispatch"), f"{prefix}.ev.mig.>"]
                )
            ]
        classes = self.classes()
        if classes:
            by_stream: dict[str, list[str]] = {}
            for cls in classes:
                stream, subject = _subject_for(cls, subjects)
                if self.instance_id is not None and subject.endswith(".instance.*"):
                    subject = subjects.instance(self.instance_id)
                if stream == subjects.loads_stream and self.instance_id is not None:
                    subject = subjects.load(self.instance_id)
                by_stream.setdefault(stream, [])
                if subject not in by_stream[stream]:
                    by_stream[stream].append(subject)
            return [StreamFilter(stream, filters) for stream, filters in by_stream.items()]
        if self.instance_id is not None:
            found.append(
                StreamFilter(
                    events,
                    [
                        subjects.instance(self.instance_id),
                        f"{prefix}.ev.sched.>",
                        f"{prefix}.ev.mig.>",
                        f"{prefix}.ev.req.>",
                    ],
                )
            )
            if self.include_loads:
                found.append(StreamFilter(subjects.loads_stream, [subjects.load(self.instance_id)]))
            return found
        found.append(StreamFilter(events, []))
        if self.include_loads:
            found.append(StreamFilter(subjects.loads_stream, []))
        return found


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: ``*`` one token, ``>`` one or more trailing tokens."""
    want, have = pattern.split("."), subject.split(".")
    for index, token in enumerate(want):
        if token == ">":
            return len(have) > index
        if index >= len(have) or (token != "*" and token != have[index]):
            return False
    return len(want) == len(have)


_INSTANCE_FIELDS = ("instance_id", "source_id", "destination_id", "failed_instance_id", "new_instance_id")


class EventMatcher:
    """Applies an :class:`EventQuery` to decoded entries, in log order.

    Stateful only in one way: a request's migrations are recognised by their
    ``PreAllocate`` (the later handshake messages do not name the request), so
    entries must be given in sequence order.
    """

    def __init__(self, query: EventQuery) -> None:
        self.query = query
        self.classes = query.classes()
        self.migrations: set[str] = set()

    def __call__(self, subject: str, time: float, body: Body) -> bool:
        query = self.query
        if query.since is not None and time < query.since:
            return False
        if query.until is not None and time > query.until:
            return False
        if query.subject is not None and not subject_matches(query.subject, subject):
            return False
        migration_id = getattr(body, "migration_id", None)
        if query.request_id is not None:
            if isinstance(body, (PreAllocate, Commit, CommitAck)) and body.request_id == query.request_id:
                self.migrations.add(body.migration_id)
            elif (
                getattr(body, "request_id", None) != query.request_id and migration_id not in self.migrations
            ):
                return False
        if query.migration_id is not None and migration_id != query.migration_id:
            return False
        if query.instance_id is not None:
            if isinstance(body, PreAllocate) and query.instance_id in (body.source_id, body.destination_id):
                self.migrations.add(body.migration_id)
            named = {getattr(body, name, None) for name in _INSTANCE_FIELDS}
            if query.instance_id not in named and migration_id not in self.migrations:
                return False
        return not self.classes or isinstance(body, self.classes)
