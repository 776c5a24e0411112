"""``shoal drill SCENARIO``: run fault-injection drills and report computed verdicts.

``SCENARIO`` is a built-in name (``--list``), ``all`` (every built-in), ``ci``
(a short subset) or a TOML or YAML file. By default each scenario starts its own
cluster (NATS, scheduler, agents, frontend, chaos proxies; ``--engine``,
``--instances`` override the scenario's); ``--against URL --nats URL`` sends
a no-fault load to a running cluster instead. The report is a table in the
terminal, ``--json FILE`` and ``--png FILE``. Exit status 0 when every
scenario passed, 1 when one failed, 2 for a bad scenario, 130 when
interrupted. SIGINT or SIGTERM stop the drill and everything it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

import click

from bus import event_loop
from bus.extras import require, require_engine

__all__ = ["drill"]


@click.command("drill")
@click.argument("scenario", required=False)
@click.option("--list", "list_scenarios", is_flag=True, help="List the built-in scenarios and exit.")
@click.option(
    "--up/--no-up", default=True, show_default=True, help="Start a cluster for each scenario (the default)."
)
@click.option("--against", default=None, metavar="URL", help="A running frontend (no-fault load only).")
@click.option("--nats", "nats_url", default=None, metavar="URL", help="NATS of the --against cluster.")
@click.option("--prefix", default=None, help="Subject prefix (--against: the cluster's; default shoal).")
@click.option(
    "--engine",
    type=click.Choice(["sim", "torch", "vllm"]),
    default=None,
    help="Override the scenario's engine (vllm: needs ./install.sh --vllm).",
)
@click.option(
    "--model",
    default=None,
    help="Override the scenario's model (torch preset, sim profile, or checkpoint folder; vllm: "
    "default a small random checkpoint built for the drill).",
)
@click.option("--instances", type=int, default=None, help="Override the scenario's number of agents.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--png", "png_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep each component's log here (default: a temporary folder, removed at the end).",
)
def drill(**options: Any) -> None:
    """Fault-injection drills against a cluster, with verified faults and computed verdicts."""
    from frontend.drill.scenario import BUILTIN, ScenarioError, resolve

    if options["list_scenarios"]:
        for name, scenario in BUILTIN.items():
            click.echo(f"{name:24} {scenario.description}")
        return
    if not options["scenario"]:
        raise click.UsageError("name a SCENARIO (see --list), 'all', 'ci' or a .toml or .yaml file")
    if (options["against"] is None) != (options["nats_url"] is None):
        raise click.UsageError("--against URL and --nats URL go together")
    if not options["up"] and options["against"] is None:
        raise click.UsageError("--no-up needs --against URL --nats URL (a running cluster)")
    try:
        scenarios = resolve(options["scenario"])
    except ScenarioError as exc:
        click.echo(f"shoal drill: {exc}", err=True)
        raise SystemExit(2) from None
    overrides = {k: options[k] for k in ("model", "instances") if options[k] is not None}
    if overrides or options["engine"] is not None:
        scenarios = [
            s.model_copy(
                update={
                    "cluster": s.cluster.on_engine(options["engine"] or s.cluster.engine).model_copy(
                        update=overrides
                    )
                }
            )
            for s in scenarios
        ]
    for scenario in scenarios:  # exit 2 naming the extra, before anything starts
        require_engine(scenario.cluster.engine)
    if options["png_path"] is not None:
        require("matplotlib")
    temporary = options["log_dir"] is None
    log_root = options["log_dir"] or Path(tempfile.mkdtemp(prefix="shoal-drill-"))
    try:
        if options["up"]:
            scenarios = _with_vllm_checkpoint(scenarios, log_root)
        results = event_loop.run(_run_all(scenarios, log_root, options))
    except asyncio.CancelledError:
        click.echo("shoal drill: interrupted; everything it started is stopped", err=True)
        raise SystemExit(130) from None
    finally:
        if temporary:
            shutil.rmtree(log_root, ignore_errors=True)
    from frontend.drill.report import print_report, write_json, write_png

    print_report(results)
    if options["json_path"] is not None:
        write_json(results, options["json_path"])
        click.echo(f"JSON: {options['json_path']}")
    if options["png_path"] is not None:
        write_png(results, options["png_path"])
        click.echo(f"PNG: {options['png_path']}")
    raise SystemExit(0 if all(r.passed for r in results) else 1)


def _with_vllm_checkpoint(scenarios: list[Any], log_root: Path) -> list[Any]:
    """Scenarios of vllm agents without a checkpoint get one, built once (vLLM loads only folders)."""
    vllm = [s for s in scenarios if s.cluster.engine == "vllm"]
    if not vllm:
        return scenarios
    from agents.engines.vllm_engine import vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason is not None:
        click.echo(f"shoal drill: {reason}", err=True)
        raise SystemExit(2)
    _check_vllm_cpu_binds(max(s.cluster.instances for s in vllm))
    if all(s.cluster.model is not None for s in vllm):
        return scenarios
    from agents.engines.vllm_engine.checkpoint import build_checkpoint

    checkpoint = str(build_checkpoint(log_root / "checkpoint"))
    click.echo(f"vllm agents serve a small random checkpoint built in {checkpoint}", err=True)
    return [
        s.model_copy(update={"cluster": s.cluster.model_copy(update={"model": checkpoint})})
        if s.cluster.engine == "vllm" and s.cluster.model is None
        else s
        for s in scenarios
    ]


def _check_vllm_cpu_binds(instances: int) -> None:
    """A malformed ``VLLM_CPU_OMP_THREADS_BIND`` is a usage error before anything starts (as in up)."""
    from agents.engines.vllm_engine import vllm_version
    from frontend.up import vllm_cpu_binds

    try:
        vllm_cpu_binds(instances, vllm_version())
    except ValueError as exc:
        raise click.UsageError(f"VLLM_CPU_OMP_THREADS_BIND: {exc}") from None


async def _run_all(scenarios: list[Any], log_root: Path, options: dict[str, Any]) -> list[Any]:
    from frontend.drill.cluster import ExternalCluster
    from frontend.drill.runner import run_scenario

    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, task.cancel)
    results = []
    for scenario in scenarios:
        against = None
        if options["against"] is not None:
            against = ExternalCluster(
                options["against"].rstrip("/"),
                options["nats_url"],
                prefix=options["prefix"] or "shoal",
                model=options["model"] or scenario.cluster.resolved_model,
            )
        result = await run_scenario(
            scenario,
            log_dir=log_root / scenario.name,
            against=against,
            echo=lambda line: click.echo(line, err=True),
            prefix=options["prefix"] or "drill",
        )
        results.append(result)
    return results
