"""The one command-line option every ``shoal`` command uses to name its NATS deployment.

``--nats URL`` (comma-separated for a cluster), also read from the
``SHOAL_NATS_URL`` environment variable by click at the entry point, never
below it. ``--nats-url``, the older spelling of some commands, still parses
but is no longer shown in ``--help``. Nothing here connects to anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

__all__ = ["DEFAULT_NATS_URL", "NATS_ENVVAR", "nats_option"]

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
