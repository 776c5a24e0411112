"""The ``shoal`` command lists its subcommands, says clearly what is not built yet, and names NATS one way."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest


def _shoal(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "from frontend.cli import main; main()", *args],
        capture_output=True, text=True, timeout=60,
    )


@pytest.mark.e2e
def test_help_lists_every_subcommand() -> None:
    result = _shoal("--help")
    assert result.returncode == 0
    for name in ("up", "agent", "scheduler", "replay", "simulate", "bench", "events"):
        assert name in result.stdout


NATS_COMMANDS = [
    ("agent",), ("serve",), ("scheduler",), ("up",), ("replay",), ("events", "export"),
    ("bench", "bus"), ("bench", "migration"), ("bench", "cluster"), ("bench", "recovery"),
]


def _command(path: tuple[str, ...]) -> click.Command:
    from frontend.cli import cli

    command: click.Command = cli
    ctx = click.Context(cli)
    for name in path:
        assert isinstance(command, click.Group)
        found = command.get_command(ctx, name)
        assert found is not None, path
        command = found
    return command


@pytest.mark.parametrize("path", NATS_COMMANDS, ids=" ".join)
def test_every_command_takes_the_nats_url_as_nats_from_the_flag_the_env_or_the_old_spelling(
    path: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    command = _command(path)
    url = "nats://a:4222,nats://b:4222"

    def parsed(*args: str) -> object:
        ctx = command.make_context(" ".join(path), list(args), resilient_parsing=True)
        return ctx.params["nats_url"]

    monkeypatch.delenv("SHOAL_NATS_URL", raising=False)
    assert parsed("--nats", url) == url
    assert parsed("--nats-url", url) == url  # the old spelling, hidden
    default = parsed()
    monkeypatch.setenv("SHOAL_NATS_URL", url)
    assert parsed() == url
    assert parsed("--nats", "nats://c:4222") == "nats://c:4222"  # the flag beats the environment
    assert default in (None, "nats://127.0.0.1:4222")
    help_text = command.get_help(click.Context(command, info_name=path[-1]))
    assert "--nats URL" in help_text and "SHOAL_NATS_URL" in help_text
    assert "--nats-url" not in help_text


def test_agent_advertises_the_transport_host_it_is_told() -> None:
    command = _command(("agent",))
    ctx = command.make_context("agent", ["--transport-host", "0.0.0.0", "--transport-advertise", "10.1.2.3"],
                               resilient_parsing=True)
    assert (ctx.params["transport_host"], ctx.params["transport_advertise"]) == ("0.0.0.0", "10.1.2.3")


def test_every_command_in_the_compose_file_parses() -> None:
    """docker/compose.yaml is not run here (no Docker engine); at least its command lines are valid."""
    from pathlib import Path

    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((Path(__file__).parents[2] / "docker" / "compose.yaml").read_text())
    commands = [s["command"] for s in compose["services"].values() if "build" in s]
    assert len(commands) == 5  # scheduler, standby, two agents, frontend
    for argv in commands:
        command = _command((argv[0],))
        ctx = command.make_context(argv[0], list(argv[1:]))  # raises on an unknown option
        assert ctx.params["nats_url"] == "nats://nats:4222"
