"""A secured NATS deployment for one shoal cluster: users per role, their permissions, a dev CA.

:func:`role_permissions` is the pure table of what each role may publish and
subscribe to, written against the subject layout of :class:`schemas.subjects.Subjects`
and the JetStream API subjects nats-py uses:

* **frontend** — request dispatch from the scheduler, send ``generate`` /
  ``abort`` / ``resend`` to any agent, read every token subject (a
  request's, and the frontends' per-step batch subjects), append request
  lifecycle events, read the events and loads streams, keep the stored
  Responses API responses in their own bucket (``<prefix>_responses``: it
  creates it and sets its TTL);
* **agent** (one user per instance) — append its own instance events and
  load reports, prefix-cache events, migration steps and request events
  (admission, preemption), publish token deltas, probes and migration handshakes, serve only its own
  RPC, handshake and cache re-sync subjects, read the events stream;
* **scheduler** (and its standby) — append decisions and instance events,
  send commands and cache re-syncs to agents, serve dispatch, hold the lease and snapshots in
  the KV bucket, archive load reports and checkpoints into the history
  stream, read all four streams (direct gets by time included);
* **observer** — read all four streams (``shoal events``, ``trace``, ``replay``);
* **admin** — everything: provisions the streams and the bucket (``shoal up``).

Only the admin may create, update or delete streams, consumers of other
names, or the scheduler's bucket (the frontend, its responses bucket only).
Replies to requests go through ``allow_responses`` (a user may answer what
it was asked, once), not a blanket ``_INBOX.>``.

:func:`create_deployment` writes a folder with an nkey seed per user, a dev
CA, a server certificate and a client certificate per user (mutual TLS), and
returns a :class:`SecureDeployment` that renders the nats-server
``authorization`` and ``tls`` blocks and gives each process its
:class:`bus.auth.NatsAuth`. The CA is for trying shoal and for tests; a
production deployment brings its own PKI and NATS accounts (pass
``--nats-creds`` / ``--nats-tls-*``).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import nkeys
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bus.auth import NatsAuth
from schemas.subjects import Subjects

__all__ = ["Identity", "Permissions", "Role", "SecureDeployment", "create_deployment", "role_permissions"]


class Role(StrEnum):
    ADMIN = "admin"
    FRONTEND = "frontend"
    AGENT = "agent"
    SCHEDULER = "scheduler"
    OBSERVER = "observer"


@dataclass(frozen=True)
class Permissions:
    """Subjects a NATS user may publish to and subscribe to (NATS wildcards allowed)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = True


def _stream_reader(stream: str) -> list[str]:
    """What an ordered push consumer on ``stream`` publishes (bus.ordered): create/delete, flow control."""
    return [
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.DELETE.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _own_bucket(bucket: str) -> list[str]:
    """What a role that keeps a KV bucket of its own publishes: create it (or set its TTL), read, write."""
    stream = f"KV_{bucket}"
    return [
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.STREAM.CREATE.{stream}",
        f"$JS.API.STREAM.UPDATE.{stream}",
        f"$KV.{bucket}.>",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.STREAM.MSG.GET.{stream}",
    ]


def role_permissions(role: Role, subjects: Subjects, instance_id: str | None = None) -> Permissions:
    """The permissions of ``role`` in the cluster named by ``subjects``; agents need their ``instance_id``."""
    p = subjects.prefix
    events, loads, bucket = subjects.events_stream, subjects.loads_stream, subjects.kv_bucket
    history, kv = subjects.history_stream, subjects.kv_stream
    if role is Role.ADMIN:
        return Permissions(publish=(">",), subscribe=(">",))
    # every bus connects the same way: stream and bucket info, nothing else of the API by default
    connect = [
        "$JS.API.INFO",
        f"$JS.API.STREAM.INFO.{events}",
        f"$JS.API.STREAM.INFO.{loads}",
        f"$JS.API.STREAM.INFO.{history}",
        f"$JS.API.STREAM.INFO.{kv}",
        f"$JS.API.STREAM.INFO.KV_{bucket}",
    ]
    # readers of the whole log (replay, trace, events): the archive too, and direct gets by time
    log_reader = [
        *_stream_reader(events),
        *_stream_reader(loads),
        *_stream_reader(history),
        *_stream_reader(kv),
        *(f"$JS.API.DIRECT.GET.{stream}" for stream in (events, loads, history, kv)),
    ]
    inbox = ["_INBOX.>"]
    if role is Role.OBSERVER:
        return Permissions(
            publish=(*connect, *log_reader), subscribe=tuple(inbox)
        )
    if role is Role.FRONTEND:
        return Permissions(
            publish=(
                *connect,
                *_stream_reader(events),
                *_stream_reader(loads),
                subjects.rpc_dispatch,
                f"{p}.rpc.agent.*.generate",
                f"{p}.rpc.agent.*.abort",
                f"{p}.rpc.agent.*.resend",
                f"{p}.ev.req.>",
                *_own_bucket(subjects.responses_bucket),
            ),
            subscribe=(*inbox, f"{p}.tok.>", f"{p}.tokb.>"),
        )
    if role is Role.SCHEDULER:
        return Permissions(
            publish=(
                *connect,
                *log_reader,
                f"{p}.hist.>",
                f"{p}.ev.sched.>",
                f"{p}.ev.instance.*",
                f"{p}.rpc.agent.*.>",
                f"{p}.kvsync.*",
                f"$KV.{bucket}.>",
                f"$JS.API.DIRECT.GET.KV_{bucket}.>",
                f"$JS.API.STREAM.MSG.GET.KV_{bucket}",
            ),
            subscribe=(*inbox, subjects.rpc_dispatch),
        )
    if role is Role.AGENT:
        if not instance_id:
            raise ValueError("an agent's permissions need its instance id")
        return Permissions(
            publish=(
                *connect,
                *_stream_reader(events),
                subjects.instance(instance_id),
                subjects.load(instance_id),
                subjects.kv(instance_id),
                f"{p}.ev.mig.>",
                f"{p}.ev.req.>",
                f"{p}.tok.>",
                f"{p}.tokb.>",
                f"{p}.rpc.mig.*",
            ),
            subscribe=(
                *inbox, f"{p}.rpc.agent.{instance_id}.>", subjects.rpc_mig(instance_id),
                subjects.kv_sync(instance_id),
            ),
        )
    raise ValueError(f"unknown role {role!r}")


@dataclass(frozen=True)
class Identity:
    """One NATS user: its name, role, nkey public key and the files that prove it."""

    name: str
    role: Role
    instance_id: str | None
    public_key: str
    seed_file: Path
    cert_file: Path
    key_file: Path


@dataclass(frozen=True)
class SecureDeployment:
    """The files :func:`create_deployment` wrote, and how to use them."""

    directory: Path
    subjects: Subjects
    ca_file: Path
    server_cert: Path
    server_key: Path
    identities: dict[str, Identity]

    def auth(self, name: str) -> NatsAuth:
        """How the user ``name`` (a role, or an agent's instance id) connects: nkey + mutual TLS."""
        identity = self.identities[name]
        return NatsAuth(
            nkey_seed=identity.seed_file,
            tls_ca=self.ca_file,
            tls_cert=identity.cert_file,
            tls_key=identity.key_file,
        )

    def server_config(self) -> str:
        """The ``tls`` and ``authorization`` blocks of nats-server's configuration (verify client certs)."""
        users = []
        for identity in self.identities.values():
            rules = role_permissions(identity.role, self.subjects, identity.instance_id)
            permissions: dict[str, object] = {
                "publish": {"allow": list(rules.publish)},
                "subscribe": {"allow": list(rules.subscribe)},
            }
            if rules.allow_responses:
                permissions["allow_responses"] = True
            users.append({"nkey": identity.public_key, "permissions": permissions})
        tls = {
            "cert_file": str(self.server_cert),
            "key_file": str(self.server_key),
            "ca_file": str(self.ca_file),
            "verify": True,
            "timeout": 5,
        }
        # nats-server's configuration format accepts JSON values
        return f"tls: {json.dumps(tls)}\nauthorization: {json.dumps({'users': users}, indent=1)}\n"


# -- the dev CA ------------------------------------------------------------------------------


def _write_private(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    os.chmod(path, 0o600)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _certificate(
    common_name: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    server_names: Sequence[str] = (),
    client: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "shoal dev"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )
    issuer_name, signing_key = issuer if issuer is not None else (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
    )
    if issuer is None:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    else:
        builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [ExtendedKeyUsageOID.SERVER_AUTH]
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if server_names:
        names: list[x509.GeneralName] = []
        for name in server_names:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                names.append(x509.DNSName(name))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def _issue(
    directory: Path, stem: str, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey], **options: object
) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(stem, key, issuer, **options)  # type: ignore[arg-type]
    cert_file, key_file = directory / f"{stem}.pem", directory / f"{stem}-key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(key_file, _key_pem(key))
    return cert_file, key_file


def create_deployment(
    directory: Path,
    subjects: Subjects,
    *,
    agents: Iterable[str],
    server_names: Sequence[str] = ("127.0.0.1", "localhost"),
    roles: Iterable[Role] = (Role.ADMIN, Role.FRONTEND, Role.SCHEDULER, Role.OBSERVER),
) -> SecureDeployment:
    """Write users (an nkey seed each), a dev CA, a server certificate and client certificates.

    Users are named after their role, agents after their instance id. Seeds and keys are
    written readable by the owner only. ``server_names`` go into the server certificate.
    """
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _certificate("shoal dev CA", ca_key, None)
    ca_file = directory / "ca.pem"
    ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_private(directory / "ca-key.pem", _key_pem(ca_key))
    issuer = (ca_cert.subject, ca_key)
    server_cert, server_key = _issue(directory, "server", issuer, server_names=tuple(server_names))
    identities: dict[str, Identity] = {}
    wanted = [(role.value, role, None) for role in roles] + [(a, Role.AGENT, a) for a in agents]
    for name, role, instance_id in wanted:
        if name in identities:
            raise ValueError(f"two users named {name!r}")
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        public_key = nkeys.from_seed(bytearray(seed)).public_key.decode()
        seed_file = directory / f"{name}.nk"
        _write_private(seed_file, seed + b"\n")
        cert_file, key_file = _issue(directory, f"client-{name}", issuer, client=True)
        identities[name] = Identity(name, role, instance_id, public_key, seed_file, cert_file, key_file)
    return SecureDeployment(directory, subjects, ca_file, server_cert, server_key, identities)
