"""``shoal replay``, with the forward what-if (``--simulate``) that needs the simulator.

The command is :func:`scheduler.replay_cli.replay` with two more options:
``--simulate`` runs :func:`scheduler.sim.whatif.forward_what_if` (the recorded
arrivals through the simulator under the recorded policy and under
``--what-if-policy``, over ``--from``/``--to``) instead of replaying; ``--to``
ends its window. It lives here because the scheduler's layer may not import
the simulator; ``shoal``'s command table points at it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
import msgspec
from rich.console import Console
from rich.table import Table

from scheduler.config import DispatchPolicy
from scheduler.events_cli import read_from_options, time_option
from scheduler.replay_cli import replay as _replay
from scheduler.sim.whatif import WhatIfError, WhatIfReport, forward_what_if

__all__ = ["replay"]

_ROWS = (
    ("TTFT P50", "ttft_p50", "ms"),
    ("TTFT P99", "ttft_p99", "ms"),
    ("TPOT P50", "tpot_p50", "ms"),
    ("TPOT P99", "tpot_p99", "ms"),
    ("E2E P50", "e2e_p50", "s"),
    ("E2E P99", "e2e_p99", "s"),
)


def _value(seconds: float, unit: str) -> str:
    return f"{seconds * 1e3:.1f} ms" if unit == "ms" else f"{seconds:.2f} s"


def _print(console: Console, report: WhatIfReport) -> None:
    recorded, same, other = report.recorded, report.simulated_recorded, report.simulated_what_if
    console.print(
        f"{report.num_requests} requests on {report.num_instances} instances, profile {report.profile} "
        f"scaled by {report.time_scale:.2f} (calibrated: the simulated TPOT P50 is the recorded one)"
    )
    table = Table(title=f"forward what-if: {recorded.policy} (recorded) vs {other.policy}")
    columns = ("", "recorded", f"sim {same.policy}", "error", f"sim {other.policy}", "vs sim recorded")
    for column in columns:
        table.add_column(column)
    for label, name, unit in _ROWS:
        rec, sim, alt = (getattr(o.latency, name) for o in (recorded, same, other))
        error = report.errors.get(name)
        change = (alt - sim) / sim if sim > 0 else 0.0
        table.add_row(
            label, _value(rec, unit), _value(sim, unit), "-" if error is None else f"{error:+.1%}",
            _value(alt, unit), f"{change:+.1%}",
        )  # fmt: skip
    for label, name in (("preemptions", "preemptions"), ("migrations", "migrations")):
        rec, sim, alt = (getattr(o, name) for o in (recorded, same, other))
        table.add_row(label, str(rec), str(sim), "", str(alt), "")
    console.print(table)


def _run(**o: Any) -> None:
    simulate, to_time = o.pop("simulate"), o.pop("to_time")
    if not simulate:
        if to_time is not None:
            raise click.UsageError("--to ends the --simulate window; use --at-time to replay up to a time")
        _replay.callback(**o)  # type: ignore[misc]
        return
    if o["what_if_policy"] is None:
        raise click.UsageError("--simulate needs --what-if-policy (the policy to predict)")
    log = read_from_options(o)
    try:
        report = forward_what_if(
            log,
            DispatchPolicy(o["what_if_policy"]),
            since=time_option(o["from_time"]),
            until=time_option(to_time),
        )
    except WhatIfError as exc:
        raise click.ClickException(str(exc)) from None
    if o["as_json"]:
        click.echo(json.dumps(msgspec.to_builtins(report)))
    else:
        _print(Console(width=None if sys.stdout.isatty() else 200), report)


replay = click.Command(
    name="replay",
    callback=_run,
    params=[
        *_replay.params,
        click.Option(
            ["--simulate"],
            is_flag=True,
            help="Forward what-if: run the recorded arrivals through the simulator under the recorded "
            "policy and --what-if-policy; show latency percentiles side by side (--from/--to: the window).",
        ),
        click.Option(["--to", "to_time"], default=None, help="End of the --simulate window (like --from)."),
    ],
    help=_replay.help,
    short_help=_replay.short_help,
)
