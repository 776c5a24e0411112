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
repeats every second on the live streams. ``--from`` recomputes only the
decisions after a time, starting from the history stream's checkpoint before
it. ``--at-time T --step S`` is the time-travel view: the cluster at ``T``
and, ``--steps`` times, what changed in each next ``S`` seconds (usage,
freeness, queues, pairings; :mod:`scheduler.timetravel`); ``--watch`` does
the same on the live streams as time passes. Rich tables for people, ``--json``
for scripts. ``shoal events`` lives in :mod:`scheduler.events_cli` (``events`` is
re-exported here for command lines that name this module).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import click
import msgspec
from rich.console import Console
from rich.table import Table

from bus.options import nats_auth_options, nats_option
from scheduler.cli import policy_from_options, policy_options
from scheduler.cluster_state import live_loads
from scheduler.config import DISPATCH_MENU, DispatchPolicy
from scheduler.events_cli import DEFAULT_PREFIX, events, read_any, time_option
from scheduler.policy.load import load_freeness
from scheduler.replay import ReplayOptions, ReplayResult, WhatIf, replay_log
from scheduler.timeline import RequestTimeline, TimelineStep, request_timeline
from scheduler.timetravel_cli import time_travel, watch
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
        "decisions_by_kind": _by_kind(result),
        "decisions_equal": sum(1 for row in result.decisions if row.matches),
        "checkpoint": None
        if result.checkpoint is None
        else {"events_seq": result.checkpoint.events_seq, "loads_seq": result.checkpoint.loads_seq},
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


def _by_kind(result: ReplayResult) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for row in result.decisions:
        counts = out.setdefault(row.kind, {"recomputed": 0, "equal": 0, "not_verifiable": 0})
        counts["recomputed"] += 1
        counts["equal"] += row.matches
        counts["not_verifiable"] += not row.verifiable
    return out


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
    kinds = ", ".join(f"{k} {c['equal']}/{c['recomputed']}" for k, c in data["decisions_by_kind"].items())
    if data["checkpoint"] is not None:
        point = data["checkpoint"]
        console.print(
            f"started from the checkpoint at events seq {point['events_seq']}, loads seq {point['loads_seq']}"
        )
    console.print(
        f"[{colour}]recomputed {data['decisions_recomputed']} decisions: "
        f"{data['decisions_equal']} equal to the recorded ones ({kinds or 'none'}), "
        f"{len(data['mismatches'])} differ, {data['decisions_outside_retention']} not verifiable "
        f"(load reports outside the retention, or an input the log lacks)[/{colour}]"
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


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _step_text(step: TimelineStep) -> str:
    d = step.detail
    if step.kind == "arrived":
        return f"{d['num_prompt_tokens']} prompt tokens, max {d['max_tokens']}, priority {d['priority']}"
    if step.kind in ("dispatched", "requeued"):
        text = f"from {d['requeued_from']}'s stalled queue, " if step.kind == "requeued" else ""
        text += f"policy {d['policy']} (epoch {d['epoch']}), fold point {d['fold_point']['events_seq']}/"
        text += f"{d['fold_point']['loads_seq']}"
        if d.get("exclude"):
            text += f", excluding {', '.join(d['exclude'])}"
        if prefix := d.get("prefix"):
            held = ", ".join(f"{key} held {n}" for key, n in prefix["cached_blocks"].items())
            text += (
                f"\n  prefix index (kv seq {prefix['kv_seq']}), of its {prefix['num_chain_blocks']} blocks: "
                f"{held or 'none held any'}"
            )
        for c in d.get("candidates", []):
            mark = "chosen" if c["instance_id"] == step.instance_id else "runner-up"
            if c["instance_id"] not in (step.instance_id, d.get("runner_up")):
                mark = "excluded" if c["excluded"] else "candidate"
            score = c.get("score")
            text += f"\n  {mark} {c['instance_id']}: " + ("" if score is None else f"score {score:.1f}, ")
            text += (
                f"freeness {c['freeness']:.1f} → {c['freeness_after']:.1f} "
                f"after admitting; running {c['num_running']}, waiting {c['num_waiting']}, "
                f"blocks {c['num_used_blocks']}/{c['num_total_blocks']}"
            )
        if "candidates" not in d:
            text += " (the state at the fold point is not in the log)"
        return text
    if step.kind == "placed":
        if not d["bypass"]:
            return "placed as dispatched"
        why = d.get("bypass_reason")
        text = "bypass: placed by the frontend without the scheduler"
        if why is None:
            return text
        return f"{text} ({why}: {d['bypass_detail']})" if d.get("bypass_detail") else f"{text} ({why})"
    if step.kind == "admitted":
        again = " again after a preemption" if d["readmission"] else ""
        return f"the engine ran it{again} after {_ms(d['queued_s'])} queued"
    if step.kind == "preempted":
        return (
            f"preempted by recompute: {d['num_blocks_freed']} blocks freed, "
            f"{d['num_output_tokens']} output tokens so far (queued again)"
        )
    if step.kind == "first_token":
        return f"TTFT {_ms(d['ttft_s'])}"
    if step.kind == "migration":
        stages = " ".join(
            f"{s['stage']}:{s['num_blocks']}blk/{_ms(s['duration_s'])}" for s in d.get("stages", [])
        )
        downtime = "" if d.get("downtime_s") is None else f", downtime {_ms(d['downtime_s'])}"
        text = f"{d['migration_id']} {d.get('source_id')} → {d.get('destination_id')}: {d.get('outcome')}"
        text += f"{downtime}; stages {stages or '-'}"
        cause = d.get("cause")
        if cause is not None:
            text += f"\n  why: {cause['cause']}"
            if cause["epoch"]:
                target = cause["target_freeness"]
                text += f" (MigrateOut of epoch {cause['epoch']}, target freeness {target:.1f})"
            if cause["source_freeness"] is not None:
                text += f", source freeness {cause['source_freeness']:.1f} when it chose the request"
        start = d["handshake"][0]["time"] if d["handshake"] else 0.0
        for h in d["handshake"]:
            extra = f" stage {h['stage']}" if "stage" in h else ""
            if h["type"] == "mig_abort":
                extra = f" {h['reason']} {h.get('detail', '')}"
            claim = " (outcome claim)" if h.get("outcome_claim") else ""
            text += f"\n  +{_ms(h['time'] - start)} {h['type']}{extra}{claim}"
        return text
    if step.kind == "rescued":
        return f"rescued from failed {d['failed_instance_id']}, {d['num_tokens_kept']} tokens kept"
    if step.kind == "finished":
        return f"{d['finish_reason']}: {d['num_output_tokens']} output tokens, e2e {_ms(d['e2e_s'])}"
    return f"aborted: {d['reason']}"


def _print_timeline(console: Console, timeline: RequestTimeline, as_json: bool) -> None:
    if not timeline.found:
        raise click.ClickException(f"request {timeline.request_id!r} is not in the log")
    if as_json:
        click.echo(json.dumps(msgspec.to_builtins(timeline)))
        return
    start = timeline.steps[0].time
    table = Table(title=f"request {timeline.request_id}")
    for column in ("at", "seq", "step", "instance", "what"):
        table.add_column(column, no_wrap=column != "what")
    for step in timeline.steps:
        table.add_row(
            f"+{_ms(step.time - start)}", str(step.seq), step.kind, step.instance_id, _step_text(step)
        )
    console.print(table)
    for p in timeline.preemptions:
        console.print(
            f"preemptions on {p.instance_id} while the request was there: {p.num_preemptions} "
            f"(+{_ms(p.start - start)} to +{_ms(p.end - start)})"
        )
    for note in timeline.notes:
        console.print(f"[dim]note: {note}[/dim]")


@click.command("replay")
@nats_option()
@nats_auth_options
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
@click.option("--what-if-policy", type=click.Choice([p.value for p in DISPATCH_MENU]), default=None)
@click.option("--what-if-low", type=float, default=None, help="Low freeness threshold for the what-if.")
@click.option("--what-if-high", type=float, default=None, help="High freeness threshold for the what-if.")
@click.option(
    "--request",
    "request_id",
    default=None,
    help="Show this request's life as a timeline instead of the state.",
)
@click.option(
    "--from",
    "from_time",
    default=None,
    help="Recompute only decisions from this time on (ISO 8601, epoch seconds or an age like 2h), "
    "starting from the checkpoint before it.",
)
@click.option(
    "--step",
    type=float,
    default=None,
    help="With --at-time: print what changed in each next STEP seconds (time travel).",
)
@click.option("--steps", type=int, default=10, show_default=True, help="How many steps --step prints.")
@click.option(
    "--watch", is_flag=True, help="Live: print what changed every --step seconds (default 1) as time passes."
)
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
        until_seq=o["at_seq"],
        until_time=time_option(o["at_time"]),
        policy=policy,
        what_if=what_if,
        from_time=time_option(o["from_time"]),
    )
    console = Console(width=None if sys.stdout.isatty() else 200)

    prefix = o["prefix"] or DEFAULT_PREFIX
    if o["step"] is not None and o["step"] <= 0:
        raise click.BadParameter("--step must be positive", param_hint="--step")
    if o["watch"]:
        if o["path"]:
            raise click.UsageError("--watch follows the live streams; use --at-time and --step with --file")
        watch(console, o["nats_url"], prefix, policy, o["step"] or 1.0, o["as_json"], o["nats_auth"])
        return
    if o["step"] is not None:
        if options.until_time is None:
            raise click.UsageError("--step needs --at-time (the first instant)")
        log = read_any(
            o["path"], o["prefix"], o["nats_url"], auth=o["nats_auth"],
            skip_corrupt=o["skip_corrupt"], replay_from=options.until_time,
        )
        time_travel(console, log, options.until_time, o["step"], o["steps"], policy, o["as_json"])
        return

    def once() -> None:
        log = read_any(
            o["path"], o["prefix"], o["nats_url"], auth=o["nats_auth"],
            skip_corrupt=o["skip_corrupt"], replay_from=options.from_time,
        )
        if o["request_id"] is not None:
            _print_timeline(console, request_timeline(log, o["request_id"], policy=policy), o["as_json"])
            return
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

