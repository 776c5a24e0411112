"""``shoal replay --at-time T --step S`` and ``--watch``: printing the time-travel view.

The cluster at an instant and what changed in each next step, as rich tables
or JSON (:mod:`scheduler.timetravel` computes them).
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import time

import click
import msgspec
from rich.console import Console
from rich.table import Table

from bus.auth import NatsAuth
from scheduler.config import PolicyConfig
from scheduler.events_cli import read_live, run_live
from scheduler.logfile import RecordedLog
from scheduler.timetravel import ClusterView, changes, cluster_view, state_at

__all__ = ["time_travel", "watch"]

_COLUMNS = ("instance", "status", "running", "waiting", "used/total", "pending", "preemptions", "freeness")


def _view_at(log: RecordedLog, at: float, policy: PolicyConfig) -> ClusterView:
    state, recorded = state_at(log, at, policy)
    return cluster_view(state, recorded, at)


def _print_view(console: Console, view: ClusterView) -> None:
    title = f"cluster at {_when(view.time)} (events seq {view.events_seq}, loads seq {view.loads_seq})"
    table = Table(title=title)
    for column in _COLUMNS:
        table.add_column(column)
    for i in view.instances.values():
        table.add_row(
            i.instance_id,
            i.status,
            str(i.running),
            str(i.waiting),
            f"{i.used_blocks}/{i.total_blocks}",
            str(i.pending),
            str(i.preemptions),
            "-inf" if i.freeness is None else f"{i.freeness:.1f}",
        )
    console.print(table)
    if view.pairings:
        console.print("pairings: " + ", ".join(f"{s} → {d}" for s, d in sorted(view.pairings.items())))


def _print_changes(console: Console, before: ClusterView, after: ClusterView) -> None:
    found = changes(before, after)
    title = f"{_when(before.time)} → {_when(after.time)}: {len(found)} changes"
    if not found:
        console.print(title)
        return
    table = Table(title=title)
    for column in ("instance / pairing", "what", "before", "after"):
        table.add_column(column)
    for change in found:
        table.add_row(change.subject, change.field, change.before, change.after)
    console.print(table)


def _when(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def time_travel(
    console: Console,
    log: RecordedLog,
    at: float,
    step: float,
    steps: int,
    policy: PolicyConfig,
    as_json: bool,
) -> None:
    """The cluster at ``at``, then what changed in each of ``steps`` steps of ``step`` seconds."""
    views = [_view_at(log, at + k * step, policy) for k in range(steps + 1)]
    if as_json:
        click.echo(
            json.dumps(
                {
                    "view": msgspec.to_builtins(views[0]),
                    "steps": [
                        {"from": a.time, "to": b.time, "changes": msgspec.to_builtins(changes(a, b))}
                        for a, b in itertools.pairwise(views)
                    ],
                }
            )
        )
        return
    _print_view(console, views[0])
    for before, after in itertools.pairwise(views):
        _print_changes(console, before, after)


def watch(
    console: Console,
    nats_url: str,
    prefix: str,
    policy: PolicyConfig,
    step: float,
    as_json: bool,
    auth: NatsAuth | None = None,
) -> None:
    """The live cluster now, then what changed every ``step`` seconds, until interrupted."""
    previous: ClusterView | None = None
    while True:
        log = run_live(read_live(nats_url, prefix, None, None, auth), nats_url, prefix)
        view = _view_at(log, time.time(), policy)
        if as_json:
            found = [] if previous is None else msgspec.to_builtins(changes(previous, view))
            click.echo(json.dumps({"time": view.time, "changes": found}), nl=True)
        elif previous is None:
            _print_view(console, view)
        else:
            _print_changes(console, previous, view)
        previous = view
        time.sleep(step)
