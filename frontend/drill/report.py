"""A drill's report: a rich table in the terminal, a JSON document, a PNG timeline.

Each verdict is ``passed``, ``failed`` or ``not checked`` (nothing to judge it
by: it fails no scenario and counts as no pass). The JSON holds, for the whole
run, per verdict how many scenarios checked it, passed, failed and did not
check it; per scenario, the verdicts with their status, the greedy answers
compared, the faults (when injected,
verified by what, healed), request counts by outcome, latency before / during
/ after the fault, recovery times, each agent's blocks once the load stopped,
the log check and every request (sent, ended, outcome). The PNG plots, per
scenario, requests sent and their outcomes per second, the latency of each
request, and the fault's span (matplotlib, Agg backend: no display needed).
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from frontend.drill.load import Outcome
from frontend.drill.runner import DrillResult

__all__ = ["print_report", "report_dict", "verdict_counts", "write_json", "write_png"]

_STATUS_CELL = {"passed": "[green]ok[/]", "failed": "[red]FAIL[/]", "not checked": "[yellow]not checked[/]"}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_report(results: Sequence[DrillResult], console: Console | None = None) -> None:
    console = console or Console()
    for result in results:
        title = f"drill {result.scenario.name}: " + ("[green]PASS[/]" if result.passed else "[red]FAIL[/]")
        table = Table(title=title, title_justify="left", show_lines=False)
        table.add_column("verdict")
        table.add_column("", justify="center")
        table.add_column("detail", overflow="fold")
        if result.error:
            table.add_row("drill ran", "[red]no[/]", result.error)
        for verdict in result.verdicts:
            table.add_row(verdict.name, _STATUS_CELL[verdict.status], verdict.detail)
        console.print(table)
        latency = Table(show_header=True, title_justify="left")
        for column in ("phase", "sent", "ok", "p50 ms", "p99 ms", "ttft p50 ms"):
            latency.add_column(column, justify="right")
        for phase, summary in result.latency.items():
            latency.add_row(
                phase,
                str(summary["requests"]),
                str(summary["ok"]),
                _ms(summary["p50_s"]),
                _ms(summary["p99_s"]),
                _ms(summary["ttft_p50_s"]),
            )
        if result.latency:
            console.print(latency)
        counts = result.counts()
        recovery = result.recovery
        first_ok = _s(recovery.get("first_ok_after_fault_s"))
        first_dispatch = _s(recovery.get("first_dispatch_after_fault_s"))
        console.print(
            f"requests: {counts['ok']} ok, {counts['error']} clean errors, {counts['lost']} lost, "
            f"{counts['mismatch']} mismatched; recovery: first ok {first_ok}s "
            f"after the fault, first dispatch {first_dispatch}s; "
            f"rescues {result.num_rescues}, preemptions {result.num_preemptions}; {result.duration_s:.1f}s\n"
        )
    if len(results) > 1:
        suite = Table(title="drill suite", title_justify="left")
        for column in ("scenario", "result", "ok", "errors", "lost", "hanging", "leaked", "recovery s"):
            suite.add_column(column)
        for result in results:
            counts = result.counts()
            suite.add_row(
                result.scenario.name,
                "[green]PASS[/]" if result.passed else "[red]FAIL[/]",
                str(counts["ok"]),
                str(counts["error"]),
                str(counts["lost"] + counts["pending"]),
                "-" if result.num_hanging is None else str(result.num_hanging),
                str(_leaked(result)),
                _s(result.recovery.get("first_ok_after_fault_s")),
            )
        console.print(suite)
        by_verdict = Table(title="verdicts over the suite (scenarios)", title_justify="left")
        for column in ("verdict", "checked", "passed", "failed", "not checked"):
            by_verdict.add_column(column, justify="left" if column == "verdict" else "right")
        for name, tally in verdict_counts(results).items():
            by_verdict.add_row(name, *(str(tally[k]) for k in ("checked", "passed", "failed", "not_checked")))
        console.print(by_verdict)


def verdict_counts(results: Sequence[DrillResult]) -> dict[str, dict[str, int]]:
    """Per verdict, over the scenarios that have it: how many checked it, passed, failed, did not check it."""
    counts: dict[str, dict[str, int]] = {}
    for result in results:
        for verdict in result.verdicts:
            tally = counts.setdefault(
                verdict.name, {"scenarios": 0, "checked": 0, "passed": 0, "failed": 0, "not_checked": 0}
            )
            tally["scenarios"] += 1
            tally["checked"] += verdict.checked
            tally[verdict.status.replace(" ", "_")] += 1
    return counts


def _greedy(result: DrillResult) -> dict[str, int]:
    greedy = [r for r in result.records if r.greedy and r.index >= 0]
    compared = [r for r in greedy if r.compared_chars is not None]
    return {
        "requests": len(greedy),
        "compared": len(compared),
        "characters": sum(r.compared_chars or 0 for r in compared),
        "mismatches": sum(1 for r in compared if r.outcome is Outcome.MISMATCH),
    }


def _leaked(result: DrillResult) -> int:
    return sum(a.num_used_blocks + a.num_reserved_blocks for a in result.agents)


def _result_dict(result: DrillResult) -> dict[str, Any]:
    return {
        "scenario": result.scenario.model_dump(mode="json"),
        "passed": result.passed,
        "error": result.error,
        "duration_s": result.duration_s,
        "verdicts": [{**asdict(v), "status": v.status} for v in result.verdicts],
        "greedy": _greedy(result),
        "faults": [f.as_dict() for f in result.faults],
        "phases": result.phases,
        "requests": result.counts(),
        "latency": result.latency,
        "recovery": result.recovery,
        "agents": [asdict(a) for a in result.agents],
        "log": None if result.log is None else asdict(result.log),
        "prefix_index": None if result.prefix is None else asdict(result.prefix),
        "hanging": result.num_hanging,
        "leaked_blocks": _leaked(result),
        "rescues": result.num_rescues,
        "preemptions": result.num_preemptions,
        "log_dir": result.log_dir,
        "timeline": {
            "columns": ["index", "sent_s", "ended_s", "outcome", "stream", "greedy", "detail"],
            "rows": [
                [r.index, round(r.sent_at, 3), None if r.ended_at is None else round(r.ended_at, 3),
                 r.outcome.value, r.stream, r.greedy, r.detail]
                for r in result.records
            ],
        },
    }


def report_dict(results: Sequence[DrillResult]) -> dict[str, Any]:
    return {
        "format": "shoal.drill/1",
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg": list(os.getloadavg()),
            "python": platform.python_version(),
        },
        "passed": all(r.passed for r in results),
        "scenarios_passed": sum(r.passed for r in results),
        "scenarios_total": len(results),
        "requests_lost": sum(r.counts()["lost"] + r.counts()["pending"] for r in results),
        "requests_hanging": sum(r.num_hanging or 0 for r in results),
        "blocks_leaked": sum(_leaked(r) for r in results),
        "verdicts": verdict_counts(results),
        "scenarios": [_result_dict(r) for r in results],
    }


def write_json(results: Sequence[DrillResult], path: Path) -> None:
    """The report as JSON: one line per scenario's top-level field, the request timeline as rows."""
    data = report_dict(results)
    scenarios = ",\n".join(json.dumps(s, default=str) for s in data.pop("scenarios"))
    head = json.dumps(data, default=str)[:-1]
    path.write_text(f'{head}, "scenarios": [\n{scenarios}\n]}}\n')


def write_png(results: Sequence[DrillResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(1, len(results))
    figure, axes = plt.subplots(rows, 2, figsize=(13, 2.8 * rows), squeeze=False)
    colors = {
        Outcome.OK: "tab:green",
        Outcome.ERROR: "tab:orange",
        Outcome.LOST: "tab:red",
        Outcome.MISMATCH: "tab:purple",
        Outcome.PENDING: "tab:gray",
    }
    for row, result in enumerate(results):
        load_ax, latency_ax = axes[row]
        end = max([result.duration_s, *(r.sent_at for r in result.records)])
        bins = list(range(int(end) + 2))
        for outcome in (Outcome.OK, Outcome.ERROR, Outcome.LOST, Outcome.MISMATCH):
            sent = [r.sent_at for r in result.records if r.outcome is outcome]
            if sent:
                load_ax.hist(
                    sent,
                    bins=bins,
                    histtype="step",
                    color=colors[outcome],
                    label=f"{outcome.value} ({len(sent)})",
                )
        load_ax.set_ylabel("requests / s (by send time)")
        load_ax.set_title(f"{result.scenario.name}: {'PASS' if result.passed else 'FAIL'}", loc="left")
        for outcome, color in colors.items():
            points = [
                (r.sent_at, r.latency_s)
                for r in result.records
                if r.outcome is outcome and r.latency_s is not None
            ]
            if points:
                latency_ax.scatter(
                    [p[0] for p in points], [p[1] for p in points], s=6, color=color, label=outcome.value
                )
        latency_ax.set_ylabel("latency s (end to end)")
        for ax in (load_ax, latency_ax):
            for fault in result.faults:
                if fault.injected_at is not None:
                    ax.axvspan(
                        fault.injected_at,
                        fault.healed_at or fault.injected_at + 0.1,
                        color="tab:red",
                        alpha=0.15,
                    )
                    ax.axvline(fault.injected_at, color="tab:red", linewidth=0.8)
            ax.set_xlabel("drill time s")
        load_ax.legend(fontsize=7, loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=60)
    plt.close(figure)
