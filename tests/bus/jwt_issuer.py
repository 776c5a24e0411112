"""A minimal NATS JWT issuer for tests: an operator, one account with JetStream, user credentials files.

Only what ``tests/bus/test_security.py`` needs to run nats-server in operator mode (``resolver:
MEMORY``) and connect with ``--nats-creds``; real deployments issue these with ``nsc``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys

__all__ = ["Operator"]


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _keypair(prefix: int) -> tuple[bytes, Any]:
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    return seed, nkeys.from_seed(bytearray(seed))


def _jwt(issuer: Any, subject: str, name: str, nats: dict[str, Any]) -> str:
    claims: dict[str, Any] = {
        "iat": int(time.time()),
        "iss": issuer.public_key.decode(),
        "name": name,
        "sub": subject,
        "nats": nats,
    }
    claims["jti"] = base64.b32encode(hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest())
    claims["jti"] = claims["jti"].decode().rstrip("=")
    header = json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode()
    signing = f"{_b64(header)}.{_b64(json.dumps(claims).encode())}"
    return f"{signing}.{_b64(issuer.sign(signing.encode()))}"


@dataclass
class Operator:
    """An operator and one account (JetStream enabled); :meth:`user_creds` writes a user's creds file."""

    def __post_init__(self) -> None:
        _, self._operator = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
        _, self._account = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
        _, self._system = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)  # JetStream needs a system account
        unlimited = {k: -1 for k in ("subs", "conn", "leaf", "imports", "exports", "data", "payload")}
        jetstream = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
        self._operator_jwt = _jwt(
            self._operator, self._operator.public_key.decode(), "op", {"type": "operator", "version": 2}
        )
        self._account_jwt = _jwt(
            self._operator,
            self._account.public_key.decode(),
            "shoal",
            {
                "type": "account",
                "version": 2,
                "limits": {**unlimited, "wildcards": True, **jetstream},
            },
        )

        self._system_jwt = _jwt(
            self._operator,
            self._system.public_key.decode(),
            "SYS",
            {"type": "account", "version": 2, "limits": {**unlimited, "wildcards": True}},
        )

    def server_config(self) -> str:
        account, system = self._account.public_key.decode(), self._system.public_key.decode()
        return (
            f"operator: {self._operator_jwt}\nsystem_account: {system}\nresolver: MEMORY\n"
            f"resolver_preload: {{ {account}: {self._account_jwt}, {system}: {self._system_jwt} }}\n"
        )

    def user_creds(self, path: Path, name: str, *, signed_by_stranger: bool = False) -> Path:
        seed, user = _keypair(nkeys.PREFIX_BYTE_USER)
        issuer = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)[1] if signed_by_stranger else self._account
        nats = {"type": "user", "version": 2, "subs": -1, "data": -1, "payload": -1}
        token = _jwt(issuer, user.public_key.decode(), name, nats)
        path.write_text(
            f"-----BEGIN NATS USER JWT-----\n{token}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n"
        )
        return path
