"""Command-line options shared by ``shoal`` commands: the NATS connection and the metrics endpoint.

Declared as typed configs (:mod:`bus.cli_config`) that every component's
config nests: :class:`NatsOptions` (``--nats URL``, comma-separated for a
cluster, also read from ``SHOAL_NATS_URL`` by click at the entry point and
never below it; its alias ``--nats-url`` parses too and is not shown in
``--help``; ``--nats-replicas``, the replication factor of the
streams and the KV bucket a component provisions; ``--prefix``, the subject
prefix of the cluster), :class:`NatsAuthOptions` (how to authenticate to
NATS and check its TLS certificate: ``--nats-user`` / ``--nats-password``,
``--nats-token``, ``--nats-nkey-seed``, ``--nats-creds``, ``--nats-tls-ca``,
``--nats-tls-cert`` / ``--nats-tls-key``, each also read from its
``SHOAL_NATS_*`` variable; secrets are never echoed, shown as defaults or put
on a child's command line) and :class:`MetricsOptions` (``--metrics-port`` /
``--metrics-host``: where a long-running process serves Prometheus
``/metrics``). The decorators (:func:`nats_option`, :func:`nats_auth_options`,
:func:`nats_replicas_option`, :func:`metrics_options`) add the same options
to commands that take no config object. Nothing here connects to or serves
anything.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import click

from bus.auth import NatsAuth
from bus.cli_config import CliConfig, ConfigError, click_options, nested, option, option_like, to_argv

__all__ = [
    "AUTH_ENVVARS",
    "DEFAULT_NATS_URL",
    "NATS_ENVVAR",
    "MetricsOptions",
    "NatsAuthOptions",
    "NatsOptions",
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
_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


@dataclasses.dataclass(frozen=True)
class NatsAuthOptions(CliConfig):
    """How a component authenticates to NATS; :attr:`auth` is the :class:`~bus.auth.NatsAuth` it makes."""

    nats_user: str | None = option("--nats-user", default=None, envvar="SHOAL_NATS_USER", metavar="TEXT",
                                   help="NATS user name (with --nats-password).")
    nats_password: str | None = option("--nats-password", default=None, envvar="SHOAL_NATS_PASSWORD",
                                       metavar="TEXT", secret=True,
                                       help="NATS password (prefer the variable).")
    nats_token: str | None = option("--nats-token", default=None, envvar="SHOAL_NATS_TOKEN", metavar="TEXT",
                                    secret=True, help="NATS authentication token (prefer the variable).")
    nats_nkey_seed: Path | None = option("--nats-nkey-seed", default=None, envvar="SHOAL_NATS_NKEY_SEED",
                                         type=_FILE, metavar="FILE",
                                         help="File holding this process's nkey seed.")
    nats_creds: Path | None = option("--nats-creds", default=None, envvar="SHOAL_NATS_CREDS", type=_FILE,
                                     metavar="FILE", help="NATS credentials file (user JWT and seed).")
    nats_tls_ca: Path | None = option("--nats-tls-ca", default=None, envvar="SHOAL_NATS_TLS_CA", type=_FILE,
                                      metavar="FILE", help="CA of the NATS server's certificate.")
    nats_tls_cert: Path | None = option("--nats-tls-cert", default=None, envvar="SHOAL_NATS_TLS_CERT",
                                        type=_FILE, metavar="FILE", help="Client certificate for mutual TLS.")
    nats_tls_key: Path | None = option("--nats-tls-key", default=None, envvar="SHOAL_NATS_TLS_KEY",
                                       type=_FILE, metavar="FILE", help="Key of the client certificate.")

    def validate(self) -> None:
        try:
            self.auth  # noqa: B018 - NatsAuth checks the combination
        except ValueError as exc:
            raise ConfigError("--nats-*", str(exc)) from None

    @property
    def auth(self) -> NatsAuth:
        values = {f.name.removeprefix("nats_"): getattr(self, f.name) for f in dataclasses.fields(self)}
        return NatsAuth(**{name: value for name, value in values.items() if value not in (None, "")})

    @classmethod
    def from_auth(cls, auth: NatsAuth) -> NatsAuthOptions:
        """The options that say ``auth`` (a parent hands its child the files of a deployment's user)."""
        return cls(**{f.name: getattr(auth, f.name.removeprefix("nats_")) for f in dataclasses.fields(cls)})


#: the environment variables of the authentication options, by :class:`NatsAuth` field
AUTH_ENVVARS: dict[str, str] = {
    f.name.removeprefix("nats_"): f.metadata["shoal.cli"].envvar for f in dataclasses.fields(NatsAuthOptions)
}


def nats_url_option(default: str | None = DEFAULT_NATS_URL, *,
                    help: str = "NATS server URL(s), comma-separated.") -> Any:
    """The ``--nats URL`` field (env ``SHOAL_NATS_URL``; hidden alias ``--nats-url``)."""
    return option("--nats", "--nats-url", default=default, envvar=NATS_ENVVAR, metavar="URL", help=help,
                  hidden_aliases=True, show_default=default is not None)


@dataclasses.dataclass(frozen=True)
class NatsOptions(CliConfig):
    """Where a component finds its cluster: the NATS deployment, how to log in, the replicas, the prefix."""

    nats_url: str = nats_url_option()
    auth: NatsAuthOptions = nested(NatsAuthOptions)
    nats_replicas: int = option(
        "--nats-replicas", default=1, min=1, max=5, envvar="SHOAL_NATS_REPLICAS",
        help="Replicas of the event and load streams and the KV bucket (needs a NATS cluster of that size).")
    prefix: str = option("--prefix", default="shoal", help="Subject prefix of the cluster.")


@dataclasses.dataclass(frozen=True)
class MetricsOptions(CliConfig):
    """Where a long-running process serves Prometheus ``/metrics`` (port None: nowhere)."""

    metrics_port: int | None = option(
        "--metrics-port", default=None, min=0, max=65535, metavar="PORT",
        help="Serve Prometheus /metrics on this port (0: any free port; unset: off).")
    metrics_host: str = option("--metrics-host", default="127.0.0.1",
                               help="Bind host of the /metrics endpoint.")


def nats_option(
    default: str | None = DEFAULT_NATS_URL, *, help: str = "NATS server URL(s), comma-separated."
) -> Callable[[_F], _F]:
    """``--nats URL`` (env ``SHOAL_NATS_URL``; hidden alias ``--nats-url``) into the ``nats_url`` parameter.

    ``default=None`` for commands that start an embedded server when no URL is given.
    """

    @dataclasses.dataclass(frozen=True)
    class _Url(CliConfig):
        nats_url: str | None = nats_url_option(default, help=help)

    return click_options(_Url)


def metrics_options(function: _F) -> _F:
    """``--metrics-port PORT`` (unset: no endpoint; 0: any free port, printed) and ``--metrics-host``."""
    return click_options(MetricsOptions)(function)


def nats_auth_options(function: _F) -> _F:
    """The NATS authentication and TLS options, handed to the command as one ``nats_auth: NatsAuth``."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, nats_auth=pop_nats_auth(kwargs), **kwargs)

    return cast(_F, click_options(NatsAuthOptions)(wrapper))


def pop_nats_auth(options: dict[str, Any]) -> NatsAuth:
    """The :class:`NatsAuth` that the authentication options' raw values in ``options`` describe (popped);
    for commands that build their parameter list by hand (``shoal replay --simulate``)."""
    values = {f.name: options.pop(f.name) for f in dataclasses.fields(NatsAuthOptions)}
    try:
        return NatsAuthOptions(**values).auth
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


def nats_replicas_option(function: _F) -> _F:
    """``--nats-replicas N`` (env ``SHOAL_NATS_REPLICAS``) into ``nats_replicas``: copies of each stream."""

    @dataclasses.dataclass(frozen=True)
    class _Replicas(CliConfig):
        nats_replicas: int = option_like(NatsOptions, "nats_replicas")

    return click_options(_Replicas)(function)


def auth_file_flags(auth: NatsAuth) -> list[str]:
    """The command-line flags that hand ``auth``'s files (seed, creds, TLS) to a child ``shoal`` process.

    Only paths travel on the command line; a password or token must go through the environment.
    """
    if auth.password is not None or auth.token:
        raise ValueError("a password or token goes to a child through SHOAL_NATS_* variables, not flags")
    return to_argv(NatsAuthOptions.from_auth(auth))
