"""The ``shoal`` command line: the one entry point for everything a user runs.

Each subcommand parses its options into a frozen config and hands it to the
component that owns the work; nothing below this module reads the
environment. Subcommands import their module only when they run, so
``shoal --help`` stays fast and imports no engine.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from frontend.packages import ForeignPackage, check_packages

__all__ = ["main"]


class LazyGroup(click.Group):
    """A group whose subcommands live in other modules and import on use.

    Keeps ``shoal --help`` fast (no torch import) and lets each component own
    its command's options. ``lazy`` maps a name to ``(module:attr, help)``.
    """

    def __init__(self, *args: Any, lazy: dict[str, tuple[str, str]] | None = None, **kw: Any):
        super().__init__(*args, **kw)
        self.lazy = lazy or {}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy:
            module_name, _, attr = self.lazy[cmd_name][0].partition(":")
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                # a dependency this command needs and this environment lacks (an optional extra)
                from bus.extras import missing_extra

                if (missing := missing_extra(exc)) is not None:
                    raise missing from exc  # names the extra to install; exit status 2
                raise click.ClickException(
                    f"'{ctx.command_path} {cmd_name}' needs the Python module '{exc.name}', "
                    "which is not installed in this environment"
                ) from exc
            command: click.Command = getattr(module, attr)
            return command
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            if name in self.lazy:
                rows.append((name, self.lazy[name][1]))
            else:
                cmd = super().get_command(ctx, name)
                if cmd is not None:
                    rows.append((name, cmd.get_short_help_str(80)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


#: Subcommand name -> (module:attribute, one-line help); the module is imported when the
#: subcommand runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("frontend.up:up", "Run a whole local cluster: NATS, scheduler, agents, frontend."),
    "agent": ("agents.cli:agent", "Run one instance agent driving an engine."),
    "scheduler": ("scheduler.cli:scheduler", "Run the global scheduler (or a standby)."),
    "serve": ("frontend.cli_serve:serve", "Run the OpenAI-compatible HTTP frontend."),
    "replay": ("scheduler.sim.replay_command:replay", "Rebuild and inspect cluster state from the log."),
    "events": ("scheduler.events_cli:events", "List, follow or export the event log."),
    "trace": ("scheduler.trace_cli:trace", "A request's or migration's trace from the log (Jaeger JSON)."),
    "simulate": ("scheduler.sim.cli:simulate", "Discrete-event cluster simulation."),
    "bench": ("frontend.bench_cli:bench", "Benchmarks: bus, engine, migration, cluster, ..."),
    "drill": (
        "frontend.drill.cli:drill",
        "Fault-injection drills with verified faults and computed verdicts.",
    ),
}


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shoal")
def cli() -> None:
    """shoal: serve LLMs on many instances and live-migrate requests between them."""


def main(argv: list[str] | None = None) -> None:
    try:
        check_packages()
    except ForeignPackage as exc:
        click.echo(f"shoal: {exc}", err=True)
        raise SystemExit(2) from None
    try:
        cli.main(args=argv if argv is not None else sys.argv[1:], prog_name="shoal")
    except Exception as exc:  # a module of an extra that is not installed: say which, exit 2
        from bus.extras import missing_extra  # here: importing bus costs `shoal --help` 0.4 s

        missing = missing_extra(exc)
        if missing is None:
            raise
        missing.show()
        raise SystemExit(missing.exit_code) from None
