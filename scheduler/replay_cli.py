"""``shoal replay``: rebuild and inspect the cluster's state from its log.

``shoal replay`` reads both streams (live, or a file written by ``shoal events
export``), rebuilds the state at a position (``--at-seq``) or a time
(``--at-time``) with :func:`scheduler.replay.replay_log`, and prints the
per-instance usage and freeness, the pairings, migrations with their stage
timings, the dispatch decisions and whether recomputing each decision gave
the recorded one. Decisions are recomputed with the policy configuration
their epoch's takeover tick recorded (``--policy``, ``--low-freeness``, ...
only for logs without one). ``--what-if`` decides every point again under
those rules changed by ``--what-if-*`` and prints where the choices differ. ``--follow``
repeats every second on the live streams. Rich tables for people, ``--json``
for scripts. ``shoal events`` lives in :mod:`scheduler.events_cli` (``events`` is
re-exported here for command lines that name this module).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click
import msgspec
from rich.console import Console
from rich.table import Table

from bus import event_loop
from scheduler.cli import policy_from_options, policy_options
from scheduler.cluster_state import live_loads
from scheduler.config import DispatchPolicy
from scheduler.events_cli import DEFAULT_PREFIX, events, read_live, read_log_file, time_option
from scheduler.policy.load import load_freeness
from scheduler.replay import ReplayOptions, ReplayResult, WhatIf, replay_log
from schemas.decisions import Dispatched

__all__ = ["events", "replay", "result_as_dict"]


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def result_as_dict(result: ReplayResult, options: ReplayOptions, limit: int) -> dict[str, Any]:
    state = result.state
    policy = result.policy
    what_if = None if options.what_if is None else options.what_if.apply(policy)
    instances = []
    for load in live_loads(state):
        record = state.instances[load.instance_id]
        instances.append(
            {
                "instance_id": load.instance_id,
                "status": record.status.value,
                "running": load.num_running,
                "used_blocks": load.num_used_blocks,
                "total_blocks": load.num_total_blocks,
                "waiting": load.num_waiting,
                "pending": load.num_pending,
                "freeness": _finite(load_freeness(load, policy)),
                "reported_freeness": load.reported_freeness,
                "stream_seq": load.stream_seq,
            }
        )
    failed = sorted(k for k, r in state.instances.items() if r.status.value == "failed")
    dispatches = [row for row in result.decisions if isinstance(row.decision, Dispatched)]
    return {
        "cursor": {"events_seq": result.cursor.events_seq, "loads_seq": result.cursor.loads_seq},
        "epoch": state.epoch,
        "policies": {str(epoch): msgspec.to_builtins(p) for epoch, p in sorted(result.policies.items())},
        "num_events": result.num_events,
        "num_loads": result.num_loads,
        "instances": instances,
        "failed_instances": failed,
        "pairings": [
            msgspec.to_builtins(p) for p in sorted(state.pairings.values(), key=lambda p: p.source_id)
        ],
        "migrations": [msgspec.to_builtins(m) for m in result.migrations[-limit:]],
        "dispatches": [
            {**msgspec.to_builtins(row.decision), "seq": row.seq, "recomputed_equal": row.matches}
            for row in dispatches[-limit:]
        ],
        "decisions_recomputed": len(result.decisions),
        "decisions_equal": sum(1 for row in result.decisions if row.matches),
        "decisions_outside_retention": result.num_unverifiable,
        "mismatches": [
            {
                "seq": row.seq,
                "recorded": msgspec.to_builtins(row.decision),
                "recomputed": msgspec.to_builtins(row.recomputed),
            }
            for row in result.mismatches[:limit]
        ],
        "what_if": None
        if what_if is None
        else {
            "policy": what_if.dispatch_policy.value,
            "low_freeness": what_if.pairing.low_freeness,
            "high_freeness": what_if.pairing.high_freeness,
            "num_differ": len(result.what_if),
            "differences": [msgspec.to_builtins(row) for row in result.what_if[:limit]],
        },
    }


def _print(console: Console, data: dict[str, Any]) -> None:
    console.print(
        f"[bold]state at events seq {data['cursor']['events_seq']}, loads seq {data['cursor']['loads_seq']}"
        f"[/bold] — epoch {data['epoch']}, {data['num_events']} events, {data['num_loads']} load reports"
    )
    for epoch, policy in data["policies"].items():
        pairing = policy["pairing"]
        console.print(
            f"epoch {epoch} recorded policy {policy['dispatch_policy']}, pairing band "
            f"[{pairing['low_freeness']}, {pairing['high_freeness']}]"
            + ("" if pairing["target_freeness"] is None else f", target {pairing['target_freeness']}")
        )
    table = Table(title="instances")
    for column in ("instance", "status", "running", "used/total", "waiting", "pending", "freeness"):
        table.add_column(column)
    for row in data["instances"]:
        freeness = "-inf" if row["freeness"] is None else f"{row['freeness']:.1f}"
        table.add_row(
            row["instance_id"],
            row["status"],
            str(row["running"]),
            f"{row['used_blocks']}/{row['total_blocks']}",
            str(row["waiting"]),
            str(row["pending"]),
            freeness,
        )
    console.print(table)
    if data["failed_instances"]:
        console.print(f"failed: {', '.join(data['failed_instances'])}")
    table = Table(title="pairings")
    for column in ("source", "destination", "target freeness", "epoch"):
        table.add_column(column)
    for p in data["pairings"]:
        table.add_row(p["source_id"], p["destination_id"], f"{p['target_freeness']:.1f}", str(p["epoch"]))
    console.print(table)
    table = Table(title="migrations")
    for column in (
        "migration",
        "request",
        "source → destination",
        "outcome",
        "stages (blocks/ms)",
        "downtime ms",
    ):
        table.add_column(column)
    for m in data["migrations"]:
        stages = " ".join(f"{s['stage']}:{s['num_blocks']}/{s['duration_s'] * 1e3:.1f}" for s in m["stages"])
        downtime = "-" if m["downtime_s"] is None else f"{m['downtime_s'] * 1e3:.1f}"
        table.add_row(
            m["migration_id"],
            m["request_id"],
            f"{m['source_id']} → {m['destination_id']}",
            m["outcome"],
            stages,
            downtime,
        )
    console.print(table)
    table = Table(title="dispatch decisions (latest)")
    for column in ("seq", "request", "instance", "policy", "epoch", "fold point", "recomputed"):
        table.add_column(column)
    for d in data["dispatches"]:
        table.add_row(
            str(d["seq"]),
            d["request_id"],
            d["instance_id"],
            d["policy"],
            str(d["epoch"]),
            f"{d['events_seq']}/{d['loads_seq']}",
            "equal" if d["recomputed_equal"] else "[red]DIFFERS",
        )
    console.print(table)
    colour = "green" if not data["mismatches"] else "red"
    console.print(
        f"[{colour}]recomputed {data['decisions_recomputed']} dispatch/pairing decisions: "
        f"{data['decisions_equal']} equal to the recorded ones, {len(data['mismatches'])} differ, "
        f"{data['decisions_outside_retention']} depended on load reports outside the retention "
        f"window[/{colour}]"
    )
    what_if = data["what_if"]
    if what_if is not None:
        table = Table(
            title=f"what if: {what_if['policy']}, pairing band "
            f"[{what_if['low_freeness']}, {what_if['high_freeness']}] — {what_if['num_differ']} differ"
        )
        for column in (
            "seq",
            "kind",
            "subject",
            "recorded",
            "what-if",
            "freeness recorded",
            "freeness what-if",
        ):
            table.add_column(column)
        for row in what_if["differences"]:
            table.add_row(
                str(row["seq"]),
                row["kind"],
                row["subject"],
                row["recorded"],
                row["alternative"],
                f"{row['recorded_freeness']:.1f}",
                f"{row['alternative_freeness']:.1f}",
            )
        console.print(table)


@click.command("replay")
@click.option("--nats-url", "--nats", "nats_url", default="nats://127.0.0.1:4222", show_default=True)
@click.option(
    "--prefix",
    default=None,
    help=f"Subject prefix (default {DEFAULT_PREFIX}; with --file: checked against the file's).",
)
@click.option(
    "--file",
    "path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Replay an exported log file instead of the live streams.",
)
@click.option("--skip-corrupt", is_flag=True, help="Skip (and report) corrupt entries of --file.")
@click.option("--at-seq", type=int, default=None, help="Rebuild the state at this events-stream sequence.")
@click.option(
    "--at-time", default=None, help="... or at this time (epoch seconds or ISO 8601, UTC if naive)."
)
@policy_options
@click.option(
    "--what-if",
    "what_if",
    is_flag=True,
    help="Decide again under the recorded rules changed by --what-if-* and show differences.",
)
@click.option("--what-if-policy", type=click.Choice([p.value for p in DispatchPolicy]), default=None)
@click.option("--what-if-low", type=float, default=None, help="Low freeness threshold for the what-if.")
@click.option("--what-if-high", type=float, default=None, help="High freeness threshold for the what-if.")
@click.option("--follow", is_flag=True, help="Tail the live streams, printing again every second.")
@click.option("--limit", type=int, default=20, show_default=True, help="Rows per table.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def replay(**o: Any) -> None:
    """Rebuild cluster state from the log and recompute the scheduler's decisions."""
    policy = policy_from_options(o["policy"], o["low_freeness"], o["high_freeness"], o["target_freeness"])
    what_if = None
    if o["what_if"] or o["what_if_policy"] or o["what_if_low"] is not None or o["what_if_high"] is not None:
        what_if = WhatIf(
            dispatch_policy=None if o["what_if_policy"] is None else DispatchPolicy(o["what_if_policy"]),
            low_freeness=o["what_if_low"],
            high_freeness=o["what_if_high"],
        )
    options = ReplayOptions(
        until_seq=o["at_seq"], until_time=time_option(o["at_time"]), policy=policy, what_if=what_if
    )
    console = Console()

    def once() -> None:
        log = (
            read_log_file(o["path"], o["prefix"], skip_corrupt=o["skip_corrupt"])
            if o["path"]
            else event_loop.run(read_live(o["nats_url"], o["prefix"] or DEFAULT_PREFIX, None, None))
        )
        data = result_as_dict(replay_log(log, options), options, o["limit"])
        if o["as_json"]:
            click.echo(json.dumps(data))
        else:
            _print(console, data)

    once()
    while o["follow"] and not o["path"]:
        import time

        time.sleep(1.0)
        console.clear()
        once()
