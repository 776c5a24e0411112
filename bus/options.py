"""Command-line options shared by ``shoal`` commands: the NATS deployment and the metrics endpoint.

``--nats URL`` (comma-separated for a cluster), also read from the
``SHOAL_NATS_URL`` environment variable by click at the entry point, never
below it. ``--nats-url``, the older spelling of some commands, still parses
but is no longer shown in ``--help``. ``--metrics-port`` / ``--metrics-host``
(:func:`metrics_options`) are where a long-running process serves Prometheus
``/metrics``. :func:`nats_auth_options` adds how to authenticate to NATS and
check its TLS certificate (``--nats-user`` / ``--nats-password``,
``--nats-token``, ``--nats-nkey-seed``, ``--nats-creds``, ``--nats-tls-ca``,
``--nats-tls-cert`` / ``--nats-tls-key``, each also read from its
``SHOAL_NATS_*`` variable) and hands the command one
:class:`bus.auth.NatsAuth` as ``nats_auth``; secrets are never echoed or
shown as defaults. :func:`nats_replicas_option` is the replication factor of
the streams and the KV bucket a component provisions. Nothing here connects
to or serves anything.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import click

from bus.auth import NatsAuth

__all__ = [
    "AUTH_ENVVARS",
    "DEFAULT_NATS_URL",
    "NATS_ENVVAR",
    "auth_file_flags",
    "metrics_options",
    "nats_auth_options",
    "nats_option",
    "nats_replicas_option",
    "pop_nats_auth",
]

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
NATS_ENVVAR = "SHOAL_NATS_URL"

_F = TypeVar("_F", bound=Callable[..., Any])


class _AliasedOption(click.Option):
    """An option whose help shows its first name only; the others are hidden aliases."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        record = super().get_help_record(ctx)
        if record is None:
            return None
        names, help_text = record
        shown = self.opts[0]
        metavar = names.rsplit(" ", 1)[-1] if " " in names else ""
        return (f"{shown} {metavar}".strip(), help_text)


def nats_option(
    default: str | None = DEFAULT_NATS_URL, *, help: str = "NATS server URL(s), comma-separated."
) -> Callable[[_F], _F]:
    """``--nats URL`` (env ``SHOAL_NATS_URL``; hidden alias ``--nats-url``) into the ``nats_url`` parameter.

    ``default=None`` for commands that start an embedded server when no URL is given.
    """
    return click.option(
        "--nats", "--nats-url", "nats_url", cls=_AliasedOption, default=default, envvar=NATS_ENVVAR,
        show_envvar=True, show_default=default is not None, metavar="URL", help=help,
    )


def metrics_options(function: _F) -> _F:
    """``--metrics-port PORT`` (unset: no endpoint; 0: any free port, printed) and ``--metrics-host``."""
    function = click.option(
        "--metrics-host", default="127.0.0.1", show_default=True, help="Bind host of the /metrics endpoint."
    )(function)
    return click.option(
        "--metrics-port", type=click.IntRange(0, 65535), default=None, metavar="PORT",
        help="Serve Prometheus /metrics on this port (0: any free port; unset: off).",
    )(function)


#: parameter → (flag, environment variable, is a file, help)
_AUTH_OPTIONS: dict[str, tuple[str, str, bool, str]] = {
    "user": ("--nats-user", "SHOAL_NATS_USER", False, "NATS user name (with --nats-password)."),
    "password": ("--nats-password", "SHOAL_NATS_PASSWORD", False, "NATS password (prefer the variable)."),
    "token": ("--nats-token", "SHOAL_NATS_TOKEN", False, "NATS authentication token (prefer the variable)."),
    "nkey_seed": ("--nats-nkey-seed", "SHOAL_NATS_NKEY_SEED", True, "File holding this process's nkey seed."),
    "creds": ("--nats-creds", "SHOAL_NATS_CREDS", True, "NATS credentials file (user JWT and seed)."),
    "tls_ca": ("--nats-tls-ca", "SHOAL_NATS_TLS_CA", True, "CA of the NATS server's certificate."),
    "tls_cert": ("--nats-tls-cert", "SHOAL_NATS_TLS_CERT", True, "Client certificate for mutual TLS."),
    "tls_key": ("--nats-tls-key", "SHOAL_NATS_TLS_KEY", True, "Key of the client certificate."),
}
#: the environment variables :func:`nats_auth_options` reads, by :class:`NatsAuth` field
AUTH_ENVVARS: dict[str, str] = {name: spec[1] for name, spec in _AUTH_OPTIONS.items()}


def nats_auth_options(function: _F) -> _F:
    """The NATS authentication and TLS options, handed to the command as one ``nats_auth: NatsAuth``."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, nats_auth=pop_nats_auth(kwargs), **kwargs)

    decorated: Callable[..., Any] = wrapper
    for name, (flag, envvar, is_file, help_text) in reversed(_AUTH_OPTIONS.items()):
        kind: click.ParamType[Any] = (
            click.Path(exists=True, dir_okay=False, path_type=Path) if is_file else click.STRING
        )
        decorated = click.option(
            flag, f"nats_{name}", type=kind, default=None, envvar=envvar, show_envvar=True,
            show_default=False, metavar="FILE" if is_file else "TEXT", help=help_text,
        )(decorated)
    return cast(_F, decorated)


def pop_nats_auth(options: dict[str, Any]) -> NatsAuth:
    """The :class:`NatsAuth` that :func:`nats_auth_options`' raw values in ``options`` describe (popped);
    for commands that build their parameter list by hand (``shoal replay --simulate``)."""
    values = {name: options.pop(f"nats_{name}") for name in _AUTH_OPTIONS}
    try:
        return NatsAuth(**{name: value for name, value in values.items() if value not in (None, "")})
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def nats_replicas_option(function: _F) -> _F:
    """``--nats-replicas N`` (env ``SHOAL_NATS_REPLICAS``) into ``nats_replicas``: copies of each stream."""
    return click.option(
        "--nats-replicas", "nats_replicas", type=click.IntRange(1, 5), default=1, show_default=True,
        envvar="SHOAL_NATS_REPLICAS", show_envvar=True,
        help="Replicas of the event and load streams and the KV bucket (needs a NATS cluster of that size).",
    )(function)


def auth_file_flags(auth: NatsAuth) -> list[str]:
    """The command-line flags that hand ``auth``'s files (seed, creds, TLS) to a child ``shoal`` process.

    Only paths travel on the command line; a password or token must go through the environment.
    """
    if auth.password is not None or auth.token:
        raise ValueError("a password or token goes to a child through SHOAL_NATS_* variables, not flags")
    flags = ["--nats-user", auth.user] if auth.user else []
    for name, (flag, _envvar, is_file, _help) in _AUTH_OPTIONS.items():
        value = getattr(auth, name)
        if is_file and value is not None:
            flags += [flag, str(value)]
    return flags
