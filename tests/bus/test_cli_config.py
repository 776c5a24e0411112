"""Typed command-line configs (bus/cli_config.py): options from fields, and a child's argv from an object."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

import click
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.engines.agent_cli import AgentCliConfig, FaultOptions
from bus.cli_config import (
    CliConfig,
    ConfigError,
    click_options,
    command_for,
    from_argv,
    from_options,
    nested,
    option,
    option_like,
    to_argv,
)
from bus.options import MetricsOptions, NatsAuthOptions, NatsOptions
from frontend.cli_serve import ServeCliConfig
from frontend.up import UpConfig, agent_config
from scheduler.cli import PolicyOptions, ScaleBandOptions, SchedulerCliConfig
from scheduler.config import DISPATCH_MENU

pytestmark = pytest.mark.unit


@dataclasses.dataclass(frozen=True)
class Inner(CliConfig):
    url: str = option("--url", default="nats://x:1", envvar="TEST_CLI_URL", help="Where.")


@dataclasses.dataclass(frozen=True)
class Sample(CliConfig):
    inner: Inner = nested(Inner)
    count: int = option("--count", default=2, min=1, max=9, help="How many.")
    ratio: float = option("--ratio", default=0.5, min=0, min_open=True)
    kind: Literal["a", "b"] = option("--kind", default="a")
    name: str | None = option("--name", default=None)
    tags: tuple[str, ...] = option("--tag", default=())
    band: tuple[float, float] = option("--band", default=(1.0, 2.0))
    verbose: bool = option("--verbose", default=False)
    drain: bool = option("--drain", secondary="--no-drain", default=True)
    path: Path | None = option("--path", default=None)
    token: str | None = option("--token", default=None, secret=True)

    def validate(self) -> None:
        if self.name == "bad":
            raise ConfigError("name", "not that name")


def _parse(cls: type[Any], argv: list[str], env: dict[str, str] | None = None) -> Any:
    seen: list[Any] = []

    @click.command()
    @click_options(cls)
    def command(**options: Any) -> None:
        seen.append(from_options(cls, options))

    result = CliRunner().invoke(command, argv, env=env or {}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return seen[0]


def test_each_field_becomes_an_option_with_its_flag_type_default_and_help() -> None:
    params = {p.name: p for p in command_for(Sample).params}
    assert set(params) == {"url", "count", "ratio", "kind", "name", "tags", "band", "verbose", "drain",
                           "path", "token"}
    assert params["count"].opts == ["--count"] and params["count"].default == 2
    assert isinstance(params["count"].type, click.IntRange)
    assert isinstance(params["kind"].type, click.Choice) and list(params["kind"].type.choices) == ["a", "b"]
    assert params["tags"].multiple and params["band"].nargs == 2
    assert params["drain"].secondary_opts == ["--no-drain"]
    help_text = command_for(Sample).get_help(click.Context(command_for(Sample)))
    assert "How many." in help_text and "TEST_CLI_URL" in help_text and "default: 2" in help_text


def test_defaults_env_vars_and_flags_build_the_frozen_object() -> None:
    assert _parse(Sample, []) == Sample()
    assert _parse(Sample, [], env={"TEST_CLI_URL": "nats://env:2"}).inner.url == "nats://env:2"
    parsed = _parse(Sample, ["--count", "3", "--tag", "x", "--tag", "y", "--no-drain", "--band", "3", "4"])
    assert (parsed.count, parsed.tags, parsed.drain, parsed.band) == (3, ("x", "y"), False, (3.0, 4.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.count = 4


def test_a_bad_value_is_a_usage_error_naming_the_flag() -> None:
    runner = CliRunner()
    command = command_for(Sample)
    cases = ((["--count", "0"], "--count"), (["--kind", "c"], "--kind"), (["--name", "bad"], "--name"))
    for argv, flag in cases:
        result = runner.invoke(command, argv)
        assert result.exit_code == 2 and flag in result.output, result.output
    assert "not that name" in runner.invoke(command, ["--name", "bad"]).output


def test_the_same_checks_hold_for_an_object_built_in_code() -> None:
    with pytest.raises(ConfigError, match="not at least 1"):
        Sample(count=0)
    with pytest.raises(ConfigError, match="not above 0"):
        Sample(ratio=0.0)
    with pytest.raises(ConfigError, match="'c' is not one of a, b"):
        Sample(kind="c")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="expected in:TYPE or out:TYPE"):
        FaultOptions(fault_drop=("sideways:Commit",))
    with pytest.raises(ConfigError, match="LOW < HIGH"):
        ScaleBandOptions(scale_band=(0.6, 0.2))
    with pytest.raises(ConfigError, match="--policy prefill_ahead"):
        SchedulerCliConfig(policy=PolicyOptions(policy="round_robin"), requeue_after_s=1.0)
    with pytest.raises(ConfigError, match="needs --model"):
        UpConfig(engine="vllm")


def test_to_argv_renders_what_differs_from_the_defaults_and_what_a_variable_could_change() -> None:
    assert to_argv(Sample()) == ["--url", "nats://x:1"]  # a child's TEST_CLI_URL must not override it
    config = Sample(inner=Inner(url="nats://y:3"), count=3, tags=("p", "q"), verbose=True, drain=False,
                    band=(0.5, 1.5), path=Path("/tmp/f"))
    assert to_argv(config) == ["--url", "nats://y:3", "--count", "3", "--tag", "p", "--tag", "q",
                               "--band", "0.5", "1.5", "--verbose", "--no-drain", "--path", "/tmp/f"]
    assert from_argv(Sample, to_argv(config)) == config


def test_a_secret_never_goes_on_a_command_line() -> None:
    with pytest.raises(ValueError, match="secret"):
        to_argv(Sample(token="hunter2"))
    with pytest.raises(ValueError, match="secret"):
        to_argv(NatsOptions(auth=NatsAuthOptions(nats_user="u", nats_password="p")))
    assert to_argv(NatsOptions()) == ["--nats", "nats://127.0.0.1:4222", "--nats-replicas", "1"]


def test_a_field_declared_like_another_keeps_its_flag_and_range() -> None:
    @dataclasses.dataclass(frozen=True)
    class Parent(CliConfig):
        count: int | None = option_like(Sample, "count", default=None, help="Passed on.")

    params = {p.name: p for p in command_for(Parent).params}
    assert params["count"].opts == ["--count"] and params["count"].default is None
    assert isinstance(params["count"].type, click.IntRange)


def test_two_options_of_one_name_are_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Twice(CliConfig):
        inner: Inner = nested(Inner)
        url: str = option("--other-url", default="")

    with pytest.raises(TypeError, match="two options of one name"):
        click_options(Twice)


def test_shoal_up_starts_each_child_from_a_config_its_command_parses_back() -> None:
    """What ``shoal up`` hands its agents, scheduler (with the auto-scaler's agent command) and frontend."""
    up = UpConfig(engine="sim", model="other-profile", num_blocks=64, time_scale=0.5, autoscale=True)
    nats = NatsOptions(nats_url="nats://127.0.0.1:5000", nats_replicas=1, prefix="t")
    agent = agent_config(up, nats, "agent-0", metrics=MetricsOptions(metrics_port=0))
    argv = to_argv(agent)
    assert argv[:2] == ["--nats", "nats://127.0.0.1:5000"] and "--profile" in argv and "--model" not in argv
    assert from_argv(AgentCliConfig, argv) == agent
    template = agent_config(up, nats, "{instance_id}")
    assert "{instance_id}" in to_argv(template)
    scheduler = SchedulerCliConfig(nats=nats, autoscale_command="shoal agent", scale=up.scale,
                                   policy=PolicyOptions(low_freeness=5.0, high_freeness=50.0))
    assert from_argv(SchedulerCliConfig, to_argv(scheduler)) == scheduler
    serve = ServeCliConfig(nats=nats, model=up.tokenizer, port=8100, stall_timeout=5.0)
    assert up.tokenizer == "sim:other-profile" and from_argv(ServeCliConfig, to_argv(serve)) == serve


# ------------------------------------------------------------------ round trip, every component

_text = st.text(st.characters(min_codepoint=48, max_codepoint=122, categories=["Ll", "Lu", "Nd"]),
                min_size=1, max_size=8)
_seconds = st.floats(min_value=0.001, max_value=1e4, allow_nan=False)


def _strategy(cls: type[Any]) -> st.SearchStrategy[Any]:
    """Configs of ``cls`` with random values in each option's type and range (secrets left unset)."""
    from typing import get_type_hints

    hints = get_type_hints(cls)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in dataclasses.fields(cls):
        meta = field.metadata.get("shoal.cli")
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type) and issubclass(hint, CliConfig):
            fields[field.name] = _strategy(hint)
        elif hint is PolicyOptions:  # declared by scheduler.cli.policy_options
            freeness = st.floats(-50, 100, allow_nan=False)
            fields[field.name] = st.builds(
                PolicyOptions, policy=st.sampled_from([p.value for p in DISPATCH_MENU]),
                low_freeness=freeness, high_freeness=st.none() | freeness,
                target_freeness=st.none() | freeness)
        elif meta is None or getattr(meta, "secret", False) or getattr(meta, "type", None) is not None:
            continue  # a nested group declared elsewhere, a secret, or a file that must exist
        else:
            fields[field.name] = _values(hint, meta)
    return st.builds(cls, **fields)


def _values(hint: Any, meta: Any) -> st.SearchStrategy[Any]:
    import types
    import typing

    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = next(a for a in args if a is not type(None))
        return st.none() | _values(inner, meta)
    if typing.get_origin(hint) is Literal:
        return st.sampled_from(args)
    if hint is bool:
        return st.booleans()
    if hint is int:
        low = 0 if meta.min is None else int(meta.min) + (1 if meta.min_open else 0)
        return st.integers(low, int(meta.max) if meta.max is not None else 10**6)
    if hint is float:
        bottom = 0.0 if meta.min is None else meta.min
        top = 1e4 if meta.max is None else meta.max
        return st.floats(bottom, top, allow_nan=False, exclude_min=meta.min_open)
    if hint is str:
        return _text
    if hint is Path:
        return _text.map(lambda t: Path("/no-such-folder-of-shoal") / t)  # dir_okay=False: not a folder
    if typing.get_origin(hint) is tuple and args[-1:] == (Ellipsis,):
        return st.lists(st.sampled_from(["out:Commit", "in:Ack"]) if "fault" in meta.flag else _text,
                        max_size=3).map(tuple)
    if typing.get_origin(hint) is tuple:
        return st.tuples(st.floats(0, 50), st.floats(51, 100))
    raise AssertionError(hint)


def _valid(cls: type[Any]) -> st.SearchStrategy[Any]:
    """Only the configs ``cls`` accepts (the cross-field checks filter the rest)."""

    def build(draw: st.DrawFn) -> Any:
        try:
            return draw(_strategy(cls))
        except ConfigError:
            return None

    return st.composite(build)().filter(lambda c: c is not None)


@pytest.mark.parametrize("cls", [AgentCliConfig, ServeCliConfig, SchedulerCliConfig, UpConfig, NatsOptions],
                         ids=lambda c: c.__name__)
@settings(max_examples=30, deadline=None)  # each example sets every option of the config at random
@given(data=st.data())
def test_every_config_survives_the_round_trip_through_its_command_line(
    cls: type[Any], data: st.DataObject
) -> None:
    config = data.draw(_valid(cls))
    with pytest.MonkeyPatch.context() as env:
        for name in ("SHOAL_NATS_URL", "SHOAL_NATS_REPLICAS", "SHOAL_API_KEY", "SHOAL_API_KEY_FILE"):
            env.delenv(name, raising=False)
        assert from_argv(cls, to_argv(config)) == config
