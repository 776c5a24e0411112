"""``shoal simulate``: one discrete-event simulation; ``shoal simulate sweep``: a rate sweep.

The entry point of the simulator: options become a frozen
:class:`~scheduler.sim.config.SimConfig` and a workload, the run shows a rich
progress bar, and the result is printed as a table and optionally written as
JSON (``--json``) and PNG plots (``--plots DIR``). Whenever a trace is
used its credit is printed. Nothing below this module reads options or the
environment.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from agents.engines.profile import load_profile
from agents.migration.fsm.config import MigrationConfig
from scheduler.config import DISPATCH_MENU, DispatchPolicy, PairingConfig, ScalingConfig
from scheduler.sim.config import MigrationModel, PolicyName, PolicySetup, SimConfig, policy_setup
from scheduler.sim.metrics import SimResult
from scheduler.sim.session_trace import is_session_trace, read_session_trace, session_trace_workload
from scheduler.sim.sessions import SessionSpec, session_workload, system_prompt_workload
from scheduler.sim.simulator import ProgressCallback
from scheduler.sim.simulator import simulate as run_simulation
from scheduler.sim.sweep import (
    GOODPUT_SHARE,
    KNEE_FACTOR,
    SloSpec,
    SweepInputError,
    SweepSpec,
    WorkloadBuilder,
    goodput,
    knee,
    median_points,
    run_sweep,
    unloaded_slo,
)
from scheduler.sim.workload import AZURE_CREDIT, Workload, build_workload, with_priorities

__all__ = ["dumps", "simulate", "simulate_command", "sweep_command"]

_POLICIES = [p.value for p in PolicyName]
#: The built-in profile a run whose prompts the chosen one rejects is pointed to.
LONG_CONTEXT_PROFILE = "llama-3.1-8b-h100"
_DISPATCH = [d.value for d in DISPATCH_MENU]


def _float_pair(text: str) -> tuple[float, float]:
    parts = text.split(",")
    if len(parts) != 2:
        raise click.BadParameter(f"expected two numbers 'x,y', got {text!r}")
    return float(parts[0]), float(parts[1])


def _cluster_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Options shared by a single run and a sweep: the cluster, migration and scaling."""
    options = [
        click.option("--instances", default=16, show_default=True,
                     help="Instances (the start when scaling)."),
        click.option("--profile", default="llama-7b-a10", show_default=True,
                     help="Engine profile: a built-in name or a file "
                     "(e.g. from `shoal bench engine --profile-out`)."),
        click.option("--dispatch", type=click.Choice(_DISPATCH), default=None,
                     help="Override the policy's dispatch rule (e.g. shoal's migration with freeness)."),
        click.option("--pairing", default=None,
                     help="Migration pairing band 'low,high' in freeness: sources below low, "
                     "destinations above high [default: 3,30; shoal 3,60]."),
        click.option("--bandwidth-gbps", default=10.0, show_default=True,
                     help="KV copy bandwidth between instances, GB/s."),
        click.option("--handshake-ms", default=2.0, show_default=True,
                     help="Round trip of a migration handshake message (one message takes half)."),
        click.option("--commit-ms", default=5.0, show_default=True,
                     help="A migration outcome's claim in the event log, append to answer."),
        click.option("--max-migrations", default=1, show_default=True,
                     help="Concurrent migrations per instance (as source and as destination each)."),
        click.option("--copy-share", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
                     help="Paced migration copies, as the agents' --migration-copy-share: a paced stage's "
                     "copy takes 1/share as long (not from a source short of memory); 0: off."),
        click.option("--last-stage-max-blocks", type=click.IntRange(min=0), default=2, show_default=True,
                     help="New full blocks a migration's last stage may copy (agents' option of that name)."),
        click.option("--max-step-tokens", type=click.IntRange(min=1), default=None,
                     help="Engines' per-step token budget (chunked prefill); default: none, a prompt "
                     "prefills in one step."),
        click.option("--cores", type=click.IntRange(min=1), default=None,
                     help="CPU cores the instances share (a CPU cluster on one machine): while n instances "
                     "compute, each steps at cores / n of its profile's speed (n > cores); default: each "
                     "instance has hardware of its own."),
        click.option("--requeue-after-s", type=click.FloatRange(min=0), default=None,
                     help="Move queued requests (no KV) off an instance whose head of line waited "
                     "this long, to one where they start at once (prefill_ahead dispatch only); "
                     "0: off. Default: the policy's own (shoal 0.5 s, others off)."),
        click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
                     help="The engines' automatic prefix caching: a prompt's cached prefix is not "
                     "computed again."),
        click.option("--report-ms", default=100.0, show_default=True, help="Load-report interval (virtual)."),
        click.option("--pairing-ms", default=100.0, show_default=True, help="Pairing interval (virtual)."),
        click.option("--autoscale/--no-autoscale", default=False, show_default=True, help="Auto-scaling."),
        click.option("--scale-band", default="10,60", show_default=True,
                     help="Auto-scaling band 'x,y' of average normal-usage freeness."),
        click.option("--min-instances", default=1, show_default=True),
        click.option("--max-instances", default=16, show_default=True),
        click.option("--sustain-s", default=10.0, show_default=True,
                     help="Seconds outside the band before scaling."),
        click.option("--startup-delay-s", default=20.0, show_default=True,
                     help="Cold start of a launched instance (the paper assumed 0)."),
        click.option("--requests", "num_requests", default=10_000, show_default=True,
                     help="Requests to simulate."),
        click.option("--cv", default=1.0, show_default=True,
                     help="Gamma arrival CV for synthetic mixes (1 = Poisson)."),
        click.option("--high-share", default=0.0, show_default=True, help="Share of high-priority requests."),
        click.option("--seed", default=0, show_default=True),
        click.option("--quiet", is_flag=True, help="No progress bar."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _group_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Options of the system-prompt groups workload (one turn, llm-d's prefix-cache benchmark)."""
    options = [
        click.option("--groups", "num_groups", type=click.IntRange(min=1), default=None,
                     help="System-prompt groups instead of a trace: one-turn requests, each a group's "
                     "system prompt and a short question, Poisson at --rate (a sweep: workload "
                     "'groups' uses 150 unless given)."),
        click.option("--group-system-tokens", type=click.IntRange(min=1), default=6000, show_default=True,
                     help="Length of a group's system prompt."),
        click.option("--question-tokens", default=128.0, show_default=True,
                     help="Mean length of a group request's question (power law)."),
        click.option("--hot-group-share", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
                     help="Share of the group requests that go to one group (the rest spread evenly)."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _groups(opts: dict[str, Any], num_requests: int, rate: float, seed: int) -> Workload:
    return system_prompt_workload(
        num_requests, rate, groups=opts["num_groups"] or 150, system_tokens=opts["group_system_tokens"],
        question_tokens=opts["question_tokens"], hot_group_share=opts["hot_group_share"], seed=seed,
    )


def _base_config(opts: dict[str, Any]) -> SimConfig:
    """A SimConfig from the shared options (its ``setup`` is replaced per policy)."""
    return SimConfig(
        profile=load_profile(opts["profile"]),
        num_instances=opts["instances"],
        migration=MigrationModel(
            bandwidth_bytes_per_s=opts["bandwidth_gbps"] * 1e9,
            handshake_latency_s=opts["handshake_ms"] / 1000.0,
            commit_latency_s=opts["commit_ms"] / 1000.0,
            config=MigrationConfig(
                max_concurrent_per_instance=opts["max_migrations"],
                copy_step_share=opts["copy_share"],
                last_stage_max_blocks=opts["last_stage_max_blocks"],
            ),
        ),
        report_interval_s=opts["report_ms"] / 1000.0,
        pairing_interval_s=opts["pairing_ms"] / 1000.0,
        autoscale=opts["autoscale"],
        startup_delay_s=opts["startup_delay_s"],
        max_step_tokens=opts["max_step_tokens"],
        requeue_after_s=opts["requeue_after_s"],
        prefix_cache=opts["prefix_cache"],
        cores=opts["cores"],
    )


def _setup(name: str, opts: dict[str, Any]) -> PolicySetup:
    pairing = None
    if opts["pairing"] is not None:
        low, high = _float_pair(opts["pairing"])
        pairing = PairingConfig(low_freeness=low, high_freeness=high)
    lo_band, hi_band = _float_pair(opts["scale_band"])
    scaling = ScalingConfig(
        min_freeness=lo_band, max_freeness=hi_band, sustain_s=opts["sustain_s"],
        min_instances=opts["min_instances"], max_instances=opts["max_instances"],
    )
    dispatch = None if opts["dispatch"] is None else DispatchPolicy(opts["dispatch"])
    return policy_setup(
        name, pairing=pairing, scaling=scaling, dispatch=dispatch
    )


def _progress(console: Console, quiet: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("virtual {task.fields[virtual]:.0f} s"), TimeElapsedColumn(),
        console=console, disable=quiet, transient=False,
    )


def _progress_callback(progress: Progress, label: str, total: int) -> ProgressCallback:
    task = progress.add_task(label, total=total, virtual=0.0)

    def update(done: int, total_requests: int, now: float) -> None:
        progress.update(task, completed=done, virtual=now)

    return update


#: Abort reasons that mean the destination had no room for the request.
NO_ROOM_REASONS = ("out_of_blocks", "too_many_incoming")


def _no_room(result: SimResult) -> int:
    return sum(n for reason, n in result.migration_abort_reasons.items() if reason in NO_ROOM_REASONS)


def _result_table(results: Sequence[SimResult]) -> Table:
    """One column per run, one row per metric (latencies in seconds)."""
    table = Table(title="simulation results")
    rows: list[tuple[str, Callable[[SimResult], str]]] = [
        ("TTFT mean / P99 (s)", lambda r: f"{r.ttft_mean_s:.3f} / {r.ttft_p99_s:.3f}"),
        ("TPOT mean / P99 (s)", lambda r: f"{r.tpot_mean_s:.4f} / {r.tpot_p99_s:.4f}"),
        ("E2E mean / P99 (s)", lambda r: f"{r.e2e_mean_s:.2f} / {r.e2e_p99_s:.2f}"),
        ("preemptions / loss (s)", lambda r: f"{r.preemptions} / {r.preemption_loss_s:.1f}"),
        ("fragmentation mean", lambda r: f"{100 * r.fragmentation_mean:.2f}%"),
        ("migrations: attempts / done / aborted",
         lambda r: f"{r.migrations_started} / {r.migrations} / {r.migrations_aborted}"),
        ("aborted: destination had no room", lambda r: f"{_no_room(r)}"),
        ("downtime mean (ms)", lambda r: f"{1000 * r.migration_downtime_mean_s:.1f}"),
        ("KV copied (GB)", lambda r: f"{r.migration_bytes / 1e9:.1f}"),
        ("paced stage copies / hurried", lambda r: f"{r.paced_copies} / {r.hurried_copies}"),
        ("churn (>3 moves) / most moves", lambda r: f"{100 * r.churn:.2f}% / {r.max_migrations_per_request}"),
        ("queued requests moved", lambda r: f"{r.requeues}"),
        ("rejected (share)", lambda r: f"{r.rejected} ({100 * r.rejected_share:.2f}%)"),
        ("instances mean", lambda r: f"{r.instances_mean:.2f}"),
        ("prefix cache hit rate (cached / prompt tokens)", _hit_rate_cell),
        ("finished / requests", lambda r: f"{r.num_finished} / {r.num_requests}"),
        ("virtual / wall (s)", lambda r: f"{r.virtual_s:.0f} / {r.wall_s:.1f}"),
    ]
    table.add_column("metric")
    for result in results:
        table.add_column(result.policy, justify="right")
    for name, fmt in rows:
        table.add_row(name, *(fmt(r) for r in results))
    return table


def _hit_rate_cell(result: SimResult) -> str:
    if not result.prefix_cache:
        return "off"
    return f"{100 * result.prefix_cache_hit_rate:.1f}% ({result.cached_tokens:,} / {result.prompt_tokens:,})"


def _cache_table(results: Sequence[SimResult]) -> Table:
    """Per instance: its prefix-cache hit rate and evictions, one column per run."""
    table = Table(title="prefix cache by instance: hit rate (evictions)")
    table.add_column("instance")
    for result in results:
        table.add_column(result.policy, justify="right")
    instance_ids = sorted({i for r in results for i in r.prefix_cache_by_instance})
    for instance_id in instance_ids:
        cells = []
        for result in results:
            entry = result.prefix_cache_by_instance.get(instance_id)
            cells.append("" if entry is None else f"{100 * entry.hit_rate:.1f}% ({entry.evictions:,})")
        table.add_row(instance_id, *cells)
    return table


def _priority_table(result: SimResult) -> Table:
    table = Table(title=f"{result.policy}: by priority class")
    for name in ("class", "count", "TTFT mean", "TTFT P99", "TPOT mean", "E2E mean", "E2E P99"):
        table.add_column(name, justify="right")
    for name, s in result.by_priority.items():
        table.add_row(
            name, str(s.count), f"{s.ttft_mean_s:.3f}", f"{s.ttft_p99_s:.3f}", f"{s.tpot_mean_s:.4f}",
            f"{s.e2e_mean_s:.2f}", f"{s.e2e_p99_s:.2f}",
        )
    return table


def _policy_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in _POLICIES]
    if bad or not names:
        raise click.BadParameter(f"unknown policies {bad}; choose from {', '.join(_POLICIES)}")
    return names


def _workload_name(trace: str | None, mix: str | None) -> str:
    if trace and mix:
        raise click.UsageError("give --trace or --mix, not both")
    return trace or mix or "azure-conv"


def _workload(opts: dict[str, Any], max_context_tokens: int) -> Workload:
    """The run's workload: sessions (``--sessions``), a trace (a recorded sessions trace among them) or
    a mix, or system-prompt groups (``--groups``)."""
    if opts["num_groups"] is not None:
        if opts["trace"] or opts["mix"] or opts["sessions"]:
            raise click.UsageError("give --groups, --sessions, --trace or --mix, not several")
        if opts["rate"] is None:
            raise click.UsageError("--groups needs --rate (requests per second)")
        try:
            workload = _groups(opts, opts["num_requests"], opts["rate"], opts["seed"])
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from exc
        return with_priorities(workload, opts["high_share"], seed=opts["seed"])
    trace = Path(opts["trace"]) if opts["trace"] else None
    if trace is not None and opts["sessions"] is None and is_session_trace(trace):
        if opts["rate"] is not None or opts["time_scale"] != 1.0:
            raise click.UsageError("a sessions trace replays closed-loop: no --rate or --time-scale")
        try:
            turns = read_session_trace(trace)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from exc
        workload = session_trace_workload(turns, name=trace.name)
        return with_priorities(workload, opts["high_share"], seed=opts["seed"])
    if opts["sessions"] is None:
        try:
            return build_workload(
                _workload_name(opts["trace"], opts["mix"]), num_requests=opts["num_requests"],
                rate=opts["rate"], cv=opts["cv"], seed=opts["seed"], high_share=opts["high_share"],
                time_scale=opts["time_scale"],
            )
        except ValueError as exc:  # no such trace, a bad trace file, a window it does not hold
            raise click.ClickException(str(exc)) from exc
    if opts["trace"] or opts["mix"]:
        raise click.UsageError("give --sessions, --trace or --mix, not several")
    if opts["rate"] is None:
        raise click.UsageError("--sessions needs --rate (sessions started per second)")
    try:
        spec = SessionSpec(
            num_sessions=opts["sessions"], rate=opts["rate"], turns=opts["turns"],
            groups=opts["session_groups"],
            system_tokens=opts["system_tokens"], user_tokens=opts["user_tokens"],
            answer_tokens=opts["answer_tokens"], think_s=opts["think_s"],
            max_context_tokens=max_context_tokens, seed=opts["seed"],
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    return with_priorities(session_workload(spec), opts["high_share"], seed=opts["seed"])


def _json_document(result: SimResult) -> dict[str, object]:
    data = result.to_dict()
    data["fragmentation_series"] = [[round(t, 2), round(v, 6)] for t, v in result.fragmentation_series]
    data["instances_series"] = [[round(t, 2), n] for t, n in result.instances_series]
    return data


_PAIR = re.compile(r"\[\s+(-?[\d.e+-]+),\s+(-?[\d.e+-]+)\s+\]")


def dumps(document: object) -> str:
    """Indented JSON with ``[time, value]`` pairs kept on one line (series stay compact)."""
    return _PAIR.sub(r"[\1, \2]", json.dumps(document, indent=1)) + "\n"


@click.group(
    name="simulate", invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.option("--policy", "policies", default="shoal", show_default=True,
              help=f"One of {', '.join(_POLICIES)}; or several, comma-separated, to compare on one workload.")
@click.option("--trace", default=None,
              help="azure-conv (default), azure-code, or a trace file: a CSV arrival_s,input_tokens,"
                   "output_tokens, an Azure, BurstGPT or Mooncake (JSON lines) trace as published, or a "
                   "sessions trace (shoal bench prefix --policies --trace-out).")
@click.option("--mix", default=None,
              help="A synthetic length mix instead of a trace: S-S, M-M, L-L, S-L or L-S.")
@click.option("--sessions", type=click.IntRange(min=1), default=None,
              help="Multi-turn chat sessions instead of a trace: this many, started at --rate per second; "
              "each turn's prompt is the previous prompt, its answer and a new message.")
@click.option("--turns", type=click.IntRange(min=1), default=4, show_default=True,
              help="Turns per session (fewer where the context would pass the profile's).")
@click.option("--session-groups", type=click.IntRange(min=1), default=4, show_default=True,
              help="Distinct system prompts; a session opens with its group's.")
@click.option("--system-tokens", type=click.IntRange(min=0), default=1024, show_default=True,
              help="Length of a group's system prompt.")
@click.option("--user-tokens", default=128.0, show_default=True,
              help="Mean length of a user message (power law, as the mixes' lengths).")
@click.option("--answer-tokens", default=256.0, show_default=True,
              help="Mean length of an answer (power law).")
@click.option("--think-s", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Mean think time between an answer and the next turn (exponential).")
@click.option("--rate", type=float, default=None,
              help="Mean request rate (req/s); traces are time-scaled to it.")
@click.option("--time-scale", default=1.0, show_default=True,
              help="Trace speed-up when --rate is not given.")
@_group_options
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the result as JSON (several policies: an object keyed by policy).")
@click.option("--plots", "plots_dir", type=click.Path(file_okay=False), default=None,
              help="Write fragmentation (and, when scaling, instances) over time PNGs here.")
@_cluster_options
@click.pass_context
def simulate_command(ctx: click.Context, /, **opts: Any) -> None:
    """Simulate a cluster on a virtual clock with the live policies (subcommand `sweep`: a rate sweep)."""
    if ctx.invoked_subcommand is not None:
        return
    console = Console()
    names = _policy_names(opts["policies"])
    base = _base_config(opts)
    workload = _workload(opts, base.profile.max_model_len)
    console.print(f"[bold]workload:[/] {workload.description}")
    for warning in workload.warnings:
        console.print(f"[bold yellow]warning:[/] {warning}")
    if workload.credit:
        console.print(f"[dim]{workload.credit}[/]")
    results: list[SimResult] = []
    with _progress(console, opts["quiet"]) as progress:
        for policy in names:
            callback = _progress_callback(progress, policy, len(workload.requests))
            config = replace(base, setup=_setup(policy, opts))
            results.append(run_simulation(config, workload, on_progress=callback))
    console.print(_result_table(results))
    if base.prefix_cache:
        console.print(_cache_table(results))
    if any(r.rejected for r in results) and base.profile.name != LONG_CONTEXT_PROFILE:
        longest = load_profile(LONG_CONTEXT_PROFILE).max_model_len
        console.print(
            f"[dim]an instance of {base.profile.name} holds prompts of up to "
            f"{min(base.profile.max_model_len, base.profile.num_blocks * base.profile.block_size):,} tokens; "
            f"--profile {LONG_CONTEXT_PROFILE} holds {longest:,}[/]"
        )
    for result in results:
        if len(result.by_priority) > 1:
            console.print(_priority_table(result))
        for warning in result.warnings:
            if warning not in workload.warnings:
                console.print(f"[bold yellow]{result.policy}:[/] {warning}")
        if result.migration_abort_reasons:
            reasons = ", ".join(f"{n} {reason}" for reason, n in result.migration_abort_reasons.items())
            console.print(f"{result.policy}: migrations aborted: {reasons}")
    if opts["json_path"]:
        path = Path(opts["json_path"])
        path.parent.mkdir(parents=True, exist_ok=True)
        document: object = (
            _json_document(results[0]) if len(results) == 1
            else {r.policy: _json_document(r) for r in results}
        )
        path.write_text(dumps(document))
        console.print(f"wrote {path}")
    if opts["plots_dir"]:
        from scheduler.sim.plots import plot_fragmentation, plot_instances

        out = Path(opts["plots_dir"])
        fragmentation = {r.policy: r.fragmentation_series for r in results}
        console.print(f"wrote {plot_fragmentation(fragmentation, out / 'fragmentation.png')}")
        if base.autoscale:
            instances = {r.policy: [(t, float(n)) for t, n in r.instances_series] for r in results}
            console.print(f"wrote {plot_instances(instances, out / 'instances.png')}")


#: Turns of a sweep's sessions (SessionSpec's default).
SWEEP_SESSION_TURNS = 4


def _sweep_builders(opts: dict[str, Any], max_context_tokens: int) -> dict[str, WorkloadBuilder]:
    """``sessions``: chat sessions of ``SessionSpec``'s defaults (4 turns, 4 system prompts of
    1,024 tokens) with the sweep's ``--think-s``, started at rate / turns so that the rate is
    requests per second; ``groups``: :func:`system_prompt_workload` with the group options."""

    def sessions(num_requests: int, rate: float, seed: int) -> Workload:
        turns = SWEEP_SESSION_TURNS
        spec = SessionSpec(
            num_sessions=max(1, -(-num_requests // turns)), rate=rate / turns, turns=turns, seed=seed,
            max_context_tokens=max_context_tokens, think_s=opts["think_s"],
        )
        return with_priorities(session_workload(spec), opts["high_share"], seed=seed)

    def groups(num_requests: int, rate: float, seed: int) -> Workload:
        return with_priorities(_groups(opts, num_requests, rate, seed), opts["high_share"], seed=seed)

    return {"sessions": sessions, "groups": groups}


@simulate_command.command(name="sweep")
@click.option("--workload", "workloads", multiple=True, default=("azure-conv",), show_default=True,
              help="Repeatable: azure-conv, azure-code, mooncake, a trace file (see --trace of simulate), "
                   "a mix (S-S, M-M, L-L, S-L, L-S), sessions (4-turn chats, 4 system prompts of 1,024 "
                   "tokens; the rate counts requests) or groups (system-prompt groups, see --groups).")
@click.option("--rates", required=True, help="Comma-separated request rates (req/s).")
@click.option("--policies", default="rr,infaas,llumnix,shoal", show_default=True)
@click.option("--out", "out_prefix", type=click.Path(), required=True,
              help="Output prefix: writes PREFIX.json and PREFIX.png.")
@click.option("--plot/--no-plot", default=True, show_default=True, help="Write PREFIX.png.")
@click.option("--seeds", default=None,
              help="Comma-separated seeds (e.g. 0,1,2): each a new synthetic draw or the next trace "
              "window of --requests rows; the table, knees and plot use the medians.")
@click.option("--slo/--no-slo", default=True, show_default=True,
              help="Judge each run by the SLO and report goodput per policy.")
@click.option("--slo-ttft-factor", default=5.0, show_default=True,
              help="SLO: TTFT at most this many times the workload's unloaded P50 TTFT.")
@click.option("--slo-tpot-factor", default=2.0, show_default=True,
              help="SLO: TPOT at most this many times the workload's unloaded P50 TPOT.")
@click.option("--unloaded-rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Rate of the unloaded run that measures the P50s [default: a tenth of the lightest rate].")
@click.option("--unloaded-requests", type=click.IntRange(min=1), default=100, show_default=True,
              help="Requests of the unloaded run (round-robin, per seed).")
@click.option("--think-s", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="Workload sessions: mean think time between an answer and the next turn. A session's "
              "turns wait for its answers, so a long think time caps the load a few sessions make.")
@_group_options
@_cluster_options
def sweep_command(
    workloads: tuple[str, ...], rates: str, policies: str, out_prefix: str, plot: bool, seeds: str | None,
    slo: bool, slo_ttft_factor: float, slo_tpot_factor: float, unloaded_rate: float | None,
    unloaded_requests: int, **opts: Any,
) -> None:
    """Run every (workload, rate, policy[, seed]) and plot latency against rate per policy."""
    console = Console()
    names = _policy_names(policies)
    base = _base_config(opts)
    spec = SweepSpec(
        workloads=tuple(workloads),
        rates=tuple(float(r) for r in rates.split(",")),
        setups=tuple(_setup(n, opts) for n in names),
        num_requests=opts["num_requests"],
        cv=opts["cv"],
        seed=opts["seed"],
        high_share=opts["high_share"],
        seeds=tuple(int(s) for s in seeds.split(",")) if seeds else (),
        builders=_sweep_builders(opts, base.profile.max_model_len),
        slo=SloSpec(
            ttft_factor=slo_ttft_factor, tpot_factor=slo_tpot_factor, unloaded_rate=unloaded_rate,
            unloaded_requests=unloaded_requests,
        ) if slo else None,
    )
    if any("azure" in w for w in workloads):
        console.print(f"[dim]{AZURE_CREDIT}[/]")
    out = Path(out_prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    slos: dict[str, dict[str, dict[str, float]]] = {}
    if spec.slo is not None:
        try:
            for workload in spec.workloads:
                slos[workload] = found = unloaded_slo(spec, base, workload)
                unloaded, bounds = found["unloaded"], found["slo"]
                console.print(
                    f"SLO ({workload}): TTFT <= {bounds['ttft_s']:.3f} s ({bounds['ttft_factor']:g}x the "
                    f"unloaded P50 {unloaded['ttft_p50_s']:.3f} s), TPOT <= {bounds['tpot_s']:.4f} s "
                    f"({bounds['tpot_factor']:g}x {unloaded['tpot_p50_s']:.4f} s); unloaded: "
                    f"{unloaded_requests} requests at {spec.unloaded_rate:g} req/s, rr, no prefix cache"
                )
        except SweepInputError as exc:
            raise click.ClickException(str(exc)) from exc
    points: list[dict[str, object]] = []
    with _progress(console, opts["quiet"]) as progress:
        overall = progress.add_task(f"sweep ({spec.num_runs} runs)", total=spec.num_runs, virtual=0.0)

        def on_start(workload: str, rate: float, setup: PolicySetup) -> ProgressCallback:
            label = f"{workload} @ {rate:g} {setup.name.value}"
            return _progress_callback(progress, label, spec.num_requests)

        def on_result(point: dict[str, object]) -> None:
            points.append(point)
            progress.advance(overall)
            out.with_suffix(".json").write_text(dumps(points))

        try:
            run_sweep(spec, base, on_start=on_start, on_result=on_result, slos=slos)
        except SweepInputError as exc:  # a trace window the trace does not hold, a bad trace file
            raise click.ClickException(str(exc)) from exc
    runs = points
    if spec.seeds:
        points = median_points(runs)
        out.with_name(out.name + "-median.json").write_text(dumps(points))
    title = f"sweep: {out.with_suffix('.json')}" + (" (medians over seeds)" if spec.seeds else "")
    table = Table(title=title)
    headers = ("workload", "rate", "policy", "TTFT mean", "TTFT P99", "TPOT P99", "SLO met", "hit rate",
               "preempt loss", "frag", "migr (attempts)", "rejected")
    for name in headers:
        table.add_column(name, justify="right")
    for p in points:
        table.add_row(
            str(p["workload"]), f"{p['rate']:g}", str(p["policy"]), f"{p['ttft_mean_s']:.3f}",
            f"{p['ttft_p99_s']:.3f}", f"{p['tpot_p99_s']:.4f}",
            f"{100 * float(str(p['slo_attainment'])):.1f}%" if spec.slo else "-",
            f"{100 * float(str(p['prefix_cache_hit_rate'])):.1f}%", f"{p['preemption_loss_s']:.1f}",
            f"{100 * float(str(p['fragmentation_mean'])):.2f}%",
            f"{p['migrations']} ({p['migrations_started']})", str(p["rejected"]),
        )
    console.print(table)
    for p in runs:  # every run's, not the medians' (which carry the first seed's)
        notes = p.get("warnings")
        for warning in notes if isinstance(notes, list) else ():
            where = f"{p['workload']} @ {p['rate']:g} seed {p.get('seed', 0)} {p['policy']}"
            console.print(f"[bold yellow]{where}:[/] {warning}")
    for workload in spec.workloads:
        knees = ", ".join(f"{name} {knee(points, workload, name)}" for name in names)
        console.print(f"knee ({workload}; P99 TTFT within {KNEE_FACTOR:g}x of the lightest rate's): {knees}")
    if spec.slo is not None:
        summary: dict[str, object] = {}
        for workload in spec.workloads:
            rates_met = {name: goodput(points, workload, name) for name in names}
            summary[workload] = {**slos[workload], "goodput": rates_met}
            shown = ", ".join(f"{name} {rate:g}" for name, rate in rates_met.items())
            console.print(
                f"goodput ({workload}; highest rate with >= {100 * GOODPUT_SHARE:g}% of requests within "
                f"the SLO, req/s; 0: not even the lightest): {shown}"
            )
        goodput_path = out.with_name(out.name + "-goodput.json")
        goodput_path.write_text(dumps(summary))
        console.print(f"wrote {goodput_path}")
    console.print(f"wrote {out.with_suffix('.json')}")
    if plot:
        from scheduler.sim.plots import plot_latency_vs_rate

        console.print(f"wrote {plot_latency_vs_rate(points, out.with_suffix('.png'))}")


#: What ``frontend.cli`` resolves ``shoal simulate`` to.
simulate = simulate_command
