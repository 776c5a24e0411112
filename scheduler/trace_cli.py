"""``shoal trace``: a request's or a migration's trace from the event log, for Jaeger UI and the terminal.

Reads the log from NATS (``--nats``/``--prefix``) or from a file written by
``shoal events export`` (``--file``), builds the trace with
:mod:`scheduler.trace_export`, writes it with ``--out`` in the JSON Jaeger UI
uploads ("Search → JSON File"), and prints a waterfall: one row per span,
indented under its parent, with a bar placed on the trace's time axis.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from bus import BusConfig, JetStreamBus, event_loop
from bus.auth import NatsAuth
from bus.options import nats_auth_options, nats_option
from scheduler.logfile import RecordedLog, load_log, read_bus_log
from scheduler.timeline import request_timeline
from scheduler.trace_export import (
    handshake_times,
    jaeger_trace,
    migration_trace,
    request_migrations,
)
from schemas import Subjects

__all__ = ["trace", "waterfall"]

_BAR = 40


async def _read_live(nats_url: str, prefix: str, auth: NatsAuth) -> RecordedLog:
    subjects = Subjects(prefix)
    config = BusConfig(url=nats_url, auth=auth, subjects=subjects, name="shoal-trace", provision=False)
    async with JetStreamBus(config) as bus:
        return await read_bus_log(bus)


def waterfall(data: dict[str, Any]) -> Table:
    """The trace as a table: span (indented by depth), service, start offset, duration, a bar."""
    table = Table(show_edge=False, box=None, pad_edge=False)
    for column in ("span", "service", "start ms", "duration ms", "timeline"):
        table.add_column(column, justify="right" if "ms" in column else "left")
    if not data["data"]:
        return table
    trace = data["data"][0]
    spans = trace["spans"]
    processes = trace["processes"]
    if not spans:
        return table
    begin = min(span["startTime"] for span in spans)
    finish = max(span["startTime"] + span["duration"] for span in spans)
    total = max(1, finish - begin)
    children: dict[str | None, list[dict[str, Any]]] = {}
    for span in spans:
        parent = span["references"][0]["spanID"] if span["references"] else None
        children.setdefault(parent, []).append(span)

    def rows(parent: str | None, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: (s["startTime"], s["operationName"])):
            left = int((span["startTime"] - begin) / total * _BAR)
            width = max(1, int(span["duration"] / total * _BAR))
            bar = " " * left + "█" * min(width, _BAR - left)
            table.add_row(
                "  " * depth + span["operationName"],
                processes[span["processID"]]["serviceName"],
                f"{(span['startTime'] - begin) / 1e3:.1f}",
                f"{span['duration'] / 1e3:.1f}",
                bar,
            )
            rows(span["spanID"], depth + 1)

    rows(None, 0)
    return table


@click.command("trace")
@click.argument("request_id", required=False)
@click.option("--migration", "migration_id", default=None, help="Trace this migration instead of a request.")
@nats_option()
@nats_auth_options
@click.option("--prefix", default="shoal", show_default=True, help="Subject prefix of the cluster.")
@click.option("--file", "path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Read a log written by `shoal events export` instead of NATS.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the trace as Jaeger UI's upload JSON here.")
@click.option("--quiet", is_flag=True, help="Do not print the waterfall.")
def trace(request_id: str | None, migration_id: str | None, nats_url: str, nats_auth: NatsAuth, prefix: str,
          path: Path | None, out: Path | None, quiet: bool) -> None:
    """Build a request's (or --migration's) trace from the event log: Jaeger JSON and a waterfall."""
    if (request_id is None) == (migration_id is None):
        raise click.UsageError("give a REQUEST_ID or --migration ID (one of them)")
    log = load_log(path) if path is not None else event_loop.run(_read_live(nats_url, prefix, nats_auth))
    if migration_id is not None:
        found = [m for m in request_migrations(log) if m.migration_id == migration_id]
        if not found:
            raise click.ClickException(f"no migration {migration_id!r} in the log")
        data = migration_trace(found[0], handshake_times(log, migration_id))
    else:
        assert request_id is not None
        steps = request_timeline(log, request_id).steps
        if not steps:
            raise click.ClickException(f"no events of request {request_id!r} in the log")
        data = jaeger_trace(request_id, steps, request_migrations(log, request_id))
    if out is not None:
        out.write_text(json.dumps(data, indent=1))
    if not quiet:
        console = Console()
        console.print(waterfall(data))
        if out is not None:
            console.print(f"wrote {out} (Jaeger UI: Search → Upload → JSON File)")
