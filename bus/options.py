"""Command-line options shared by ``shoal`` commands: the NATS deployment and the metrics endpoint.

``--nats URL`` (comma-separated for a cluster), also read from the
``SHOAL_NATS_URL`` environment variable by click at the entry point, never
below it. ``--nats-url``, the older spelling of some commands, still parses
but is no longer shown in ``--help``. ``--metrics-port`` / ``--metrics-host``
(:func:`metrics_options`) are where a long-running process serves Prometheus
``/metrics``. Nothing here connects to or serves anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

__all__ = ["DEFAULT_NATS_URL", "NATS_ENVVAR", "metrics_options", "nats_option"]

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
