"""How a shoal process proves who it is to NATS, and how it checks the server: :class:`NatsAuth`.

The standard nats-py ways, one frozen object passed in (nothing here reads
the environment; :mod:`bus.options` turns flags and ``SHOAL_NATS_*``
variables into one): user and password, a token, an nkey seed file, a
credentials file (user JWT + seed, for operator/account deployments), and
TLS with a CA bundle, optionally with a client certificate and key (mTLS).
Secrets never appear in ``repr`` and :func:`redact_url` masks what a URL
carries (``nats://user:secret@host`` → ``nats://user:***@host``), so logs
and errors never show them. Nothing here connects to anything.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = ["NatsAuth", "redact_url"]


@dataclass(frozen=True)
class NatsAuth:
    """Credentials and TLS settings for one NATS connection; the empty default is no authentication.

    At most one of password (with ``user``), ``token``, ``nkey_seed`` and
    ``creds`` (files hold the secrets, so only their paths are kept).
    ``tls_ca`` turns TLS on with that CA; ``tls_cert`` and ``tls_key``
    (together) add a client certificate; ``tls_hostname`` overrides the
    name checked in the server's certificate.
    """

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    nkey_seed: Path | None = None
    creds: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_hostname: str | None = None

    def __post_init__(self) -> None:
        if self.password is not None and not self.user:
            raise ValueError("a NATS password needs a user")
        methods = [
            name
            for name, value in (
                ("user/password", self.user),
                ("token", self.token),
                ("nkey seed", self.nkey_seed),
                ("credentials file", self.creds),
            )
            if value
        ]
        if len(methods) > 1:
            raise ValueError(f"choose one NATS authentication method, not {' and '.join(methods)}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("a TLS client certificate needs its key, and a key its certificate")
        for name in ("nkey_seed", "creds", "tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"NATS {name.replace('_', ' ')} file not found: {path}")

    @property
    def method(self) -> str:
        """What this object authenticates with, for logs: never the secret itself."""
        if self.creds:
            return "creds"
        if self.nkey_seed:
            return "nkey"
        if self.token:
            return "token"
        if self.user:
            return "user"
        return "none"

    @property
    def uses_tls(self) -> bool:
        return self.tls_ca is not None or self.tls_cert is not None

    def ssl_context(self) -> ssl.SSLContext | None:
        """A client TLS context verifying the server with ``tls_ca`` (and presenting our certificate)."""
        if not self.uses_tls:
            return None
        context = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=str(self.tls_ca) if self.tls_ca else None
        )
        if self.tls_cert is not None and self.tls_key is not None:
            context.load_cert_chain(str(self.tls_cert), str(self.tls_key))
        return context

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect`` (only those that are set)."""
        options: dict[str, Any] = {}
        if self.user:
            options["user"] = self.user
            if self.password is not None:
                options["password"] = self.password
        if self.token:
            options["token"] = self.token
        if self.nkey_seed is not None:
            options["nkeys_seed"] = str(self.nkey_seed)
        if self.creds is not None:
            options["user_credentials"] = str(self.creds)
        context = self.ssl_context()
        if context is not None:
            options["tls"] = context
            if self.tls_hostname:
                options["tls_hostname"] = self.tls_hostname
        return options


def redact_url(url: str) -> str:
    """``url`` (comma-separated servers allowed) with any password or token replaced by ``***``."""
    parts = []
    for part in url.split(","):
        stripped = part.strip()
        try:
            split = urlsplit(stripped)
        except ValueError:
            parts.append("<unparsable url>")
            continue
        if "@" not in split.netloc:
            parts.append(stripped)
            continue
        userinfo, host = split.netloc.rsplit("@", 1)
        user, sep, _secret = userinfo.partition(":")
        masked = f"{user}:***" if sep else "***"
        parts.append(urlunsplit(split._replace(netloc=f"{masked}@{host}")))
    return ",".join(parts)
