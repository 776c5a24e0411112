"""NATS security against a real nats-server with ``shoal up --secure``'s users and mutual TLS.

Unauthenticated, wrong-credential and certificate-less clients are refused; each role can do
its job; a component publishing or subscribing outside its role is refused by the server,
and the violation is counted (``shoal_nats_permission_violations_total``) and logged.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path

import nkeys
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from bus import AppendTimeout, BusConfig, BusTimeout, JetStreamBus, NatsAuth, NotConnected
from bus.metrics import BusCollector
from bus.security import Role, create_deployment, role_permissions
from schemas import Subjects
from tests.bus.helpers import short_config
from tests.conftest import SecureNats


def _config(secure: SecureNats, name: str, auth: NatsAuth | None = None) -> BusConfig:
    return short_config(
        secure.url,
        secure.subjects,
        auth=secure.auth(name) if auth is None else auth,
        name=name,
        connect_attempts=1,
        connect_timeout=2.0,
    )


async def _connected(secure: SecureNats, name: str) -> JetStreamBus:
    bus = JetStreamBus(_config(secure, name))
    await bus.connect()
    return bus


async def test_unauthenticated_client_is_refused(secure_nats: SecureNats) -> None:
    tls_only = NatsAuth(tls_ca=secure_nats.deployment.ca_file)
    with pytest.raises(NotConnected):
        await JetStreamBus(_config(secure_nats, "anonymous", tls_only)).connect()


async def test_client_without_a_certificate_is_refused(secure_nats: SecureNats) -> None:
    identity = secure_nats.deployment.identities["frontend"]
    no_cert = NatsAuth(nkey_seed=identity.seed_file, tls_ca=secure_nats.deployment.ca_file)
    with pytest.raises(NotConnected):
        await JetStreamBus(_config(secure_nats, "frontend", no_cert)).connect()


async def test_unknown_nkey_is_refused(secure_nats: SecureNats, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger.nk"
    stranger.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    forged = replace(secure_nats.auth("frontend"), nkey_seed=stranger)
    with pytest.raises(NotConnected):
        await JetStreamBus(_config(secure_nats, "frontend", forged)).connect()


async def test_certificate_of_another_ca_is_refused(secure_nats: SecureNats, tmp_path: Path) -> None:
    other = create_deployment(tmp_path / "other", secure_nats.subjects, agents=())
    wrong_ca = replace(secure_nats.auth("frontend"), tls_ca=other.ca_file)  # cannot verify the server
    with pytest.raises(NotConnected):
        await JetStreamBus(_config(secure_nats, "frontend", wrong_ca)).connect()
    foreign_cert = replace(
        secure_nats.auth("frontend"),
        tls_cert=other.identities["frontend"].cert_file,
        tls_key=other.identities["frontend"].key_file,
    )
    with pytest.raises(NotConnected):
        await JetStreamBus(_config(secure_nats, "frontend", foreign_cert)).connect()


async def test_each_role_can_do_its_job(secure_nats: SecureNats) -> None:
    subjects = secure_nats.subjects
    agent = await _connected(secure_nats, "a1")
    scheduler = await _connected(secure_nats, "scheduler")
    frontend = await _connected(secure_nats, "frontend")
    observer = await _connected(secure_nats, "observer")
    try:
        position = await agent.append(subjects.load("a1"), b"load")
        await agent.append(subjects.instance("a1"), b"joined")
        decision = await scheduler.append(subjects.sched("dispatch"), b"decision")
        await frontend.append(subjects.req("r1"), b"arrived")
        responses = await frontend.kv_bucket(subjects.responses_bucket, max_age=3600.0)  # its own bucket
        stored = await responses.put("resp_1", b"stored")
        assert await responses.get("resp_1") == (b"stored", stored)
        await responses.delete("resp_1")
        revision = await scheduler.kv_put("scheduler.test", b"lease")
        assert (await scheduler.kv_get("scheduler.test")) == (b"lease", revision)
        service = await scheduler.serve(subjects.rpc_dispatch, _echo)
        reply = await frontend.request(subjects.rpc_dispatch, b"place me", timeout=2.0)
        assert reply.data == b"place me"
        await service.stop()
        async with observer.replay(subjects.loads_stream, from_seq=position.seq) as feed:
            first = await anext(feed)
        assert first.data == b"load"
        async with observer.replay(subjects.events_stream, from_seq=decision.seq) as feed:
            assert (await anext(feed)).data == b"decision"
        for bus in (agent, scheduler, frontend, observer):
            assert bus.permission_violations == {}
    finally:
        for bus in (agent, scheduler, frontend, observer):
            await bus.close()


async def _echo(data: bytes, headers: dict[str, str]) -> bytes:
    return data


async def test_agent_publishing_outside_its_role_is_refused_and_counted(
    secure_nats: SecureNats, caplog: pytest.LogCaptureFixture
) -> None:
    subjects = secure_nats.subjects
    agent = await _connected(secure_nats, "a1")
    victim = await _connected(secure_nats, "a2")
    try:
        drains = await victim.subscribe(subjects.rpc_agent("a2", "drain"))
        # a scheduler command to another agent, and another agent's load report
        await agent.publish(subjects.rpc_agent("a2", "drain"), b"drain!")
        with pytest.raises(AppendTimeout):
            await agent.append(subjects.load("a2"), b"forged load", timeout=1.5)
        with pytest.raises(AppendTimeout):
            await agent.append(subjects.sched("dispatch"), b"forged decision", timeout=1.5)
        # listening in on another agent's RPCs
        await agent.subscribe(subjects.rpc_agent("a2", "generate"))
        await asyncio.sleep(0.3)
        assert agent.permission_violations["publish"] >= 3
        assert agent.permission_violations["subscribe"] == 1
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await anext(drains)
        registry = CollectorRegistry()
        registry.register(BusCollector(lambda: agent))
        text = generate_latest(registry).decode()
        assert 'shoal_nats_permission_violations_total{operation="subscribe"} 1.0' in text
        assert "refused by the NATS server" in caplog.text
        assert agent.is_connected  # a violation is reported, not fatal
        await agent.append(subjects.load("a1"), b"still works")
    finally:
        await agent.close()
        await victim.close()


async def test_frontend_cannot_command_agents_or_touch_the_lease(secure_nats: SecureNats) -> None:
    frontend = await _connected(secure_nats, "frontend")
    try:
        await frontend.publish(secure_nats.subjects.rpc_agent("a1", "migrate_out"), b"x")
        with pytest.raises(BusTimeout):  # the KV put is a refused publish: no ack
            await frontend.kv_put("scheduler.lease", b"mine")
        await asyncio.sleep(0.2)
        assert frontend.permission_violations["publish"] >= 2
    finally:
        await frontend.close()


def test_agent_permissions_name_only_its_own_subjects() -> None:
    subjects = Subjects("c")
    rules = role_permissions(Role.AGENT, subjects, "i7")
    assert "c.load.i7" in rules.publish and "c.ev.instance.i7" in rules.publish
    assert not any(s.startswith(("c.load.*", "c.ev.sched", "c.rpc.agent", "$KV", ">")) for s in rules.publish)
    assert "c.kv.i7" in rules.publish and not any(s.startswith("c.kv.*") for s in rules.publish)
    assert set(rules.subscribe) == {"_INBOX.>", "c.rpc.agent.i7.>", "c.rpc.mig.i7", "c.kvsync.i7"}
    assert not any("STREAM.CREATE" in s or "STREAM.UPDATE" in s for s in rules.publish)
    with pytest.raises(ValueError):
        role_permissions(Role.AGENT, subjects)


def test_auth_never_shows_secrets() -> None:
    from bus.auth import redact_url

    auth = NatsAuth(user="u", password="hunter2")
    assert "hunter2" not in repr(auth) and "hunter2" not in repr(BusConfig(auth=auth))
    assert redact_url("nats://u:hunter2@h:4222,nats://tok3n@g:1") == "nats://u:***@h:4222,nats://***@g:1"
    assert NatsAuth(token="t0k").method == "token" and "t0k" not in repr(NatsAuth(token="t0k"))
    with pytest.raises(ValueError, match="one NATS authentication method"):
        NatsAuth(user="u", password="p", token="t")
    with pytest.raises(ValueError, match="needs a user"):
        NatsAuth(password="p")


async def test_password_in_the_url_is_redacted_in_the_error() -> None:
    config = BusConfig(url="nats://u:hunter2@127.0.0.1:1", connect_attempts=1, connect_timeout=0.5)
    with pytest.raises(NotConnected) as raised:
        await JetStreamBus(config).connect()
    assert "hunter2" not in str(raised.value) and "u:***@" in str(raised.value)


@pytest.mark.parametrize(
    ("server_auth", "good", "bad"),
    [
        ('authorization { token: "s3cret-token" }', NatsAuth(token="s3cret-token"), NatsAuth(token="guess")),
        (
            'authorization { user: "svc", password: "s3cret-pw" }',
            NatsAuth(user="svc", password="s3cret-pw"),
            NatsAuth(user="svc", password="guess"),
        ),
    ],
    ids=["token", "user-password"],
)
async def test_token_and_password_authentication(
    tmp_path: Path, server_auth: str, good: NatsAuth, bad: NatsAuth
) -> None:
    from bus.server import EmbeddedNats

    with EmbeddedNats(store_dir=tmp_path / "store", extra_config=server_auth) as server:
        subjects = Subjects("tok")
        async with JetStreamBus(short_config(server.url, subjects, auth=good, connect_attempts=1)) as bus:
            await bus.append(subjects.load("i0"), b"in")
        for auth in (bad, NatsAuth()):
            with pytest.raises(NotConnected) as refused:
                await JetStreamBus(
                    short_config(server.url, subjects, auth=auth, connect_attempts=1)
                ).connect()
            assert "s3cret" not in str(refused.value) and "guess" not in str(refused.value)


def test_auth_options_read_flags_and_variables_into_one_object(tmp_path: Path) -> None:
    import click
    from click.testing import CliRunner

    from bus.options import auth_file_flags, nats_auth_options

    seen: list[NatsAuth] = []

    @click.command()
    @nats_auth_options
    def command(nats_auth: NatsAuth) -> None:
        seen.append(nats_auth)

    seed = tmp_path / "me.nk"
    seed.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    runner = CliRunner()
    assert runner.invoke(command, [], env={"SHOAL_NATS_TOKEN": "t0k"}).exit_code == 0
    assert seen[-1].token == "t0k" and seen[-1].method == "token"
    assert runner.invoke(command, ["--nats-nkey-seed", str(seed)]).exit_code == 0
    assert seen[-1].nkey_seed == seed and auth_file_flags(seen[-1]) == ["--nats-nkey-seed", str(seed)]
    both = runner.invoke(command, ["--nats-nkey-seed", str(seed)], env={"SHOAL_NATS_TOKEN": "t0k"})
    assert (
        both.exit_code == 2 and "one NATS authentication method" in both.output and "t0k" not in both.output
    )
    with pytest.raises(ValueError):
        auth_file_flags(NatsAuth(token="t0k"))  # secrets never go on a command line


async def test_creds_file_in_operator_mode(tmp_path: Path) -> None:
    """``--nats-creds``: a user JWT signed by the account the server trusts; one from elsewhere is refused."""
    from bus.server import EmbeddedNats
    from tests.bus.jwt_issuer import Operator

    operator = Operator()
    with EmbeddedNats(store_dir=tmp_path / "store", extra_config=operator.server_config()) as server:
        subjects = Subjects("creds")
        good = NatsAuth(creds=operator.user_creds(tmp_path / "agent.creds", "agent"))
        async with JetStreamBus(short_config(server.url, subjects, auth=good, connect_attempts=1)) as bus:
            position = await bus.append(subjects.load("i0"), b"in")
            assert position.seq == 1
        forged = NatsAuth(creds=operator.user_creds(tmp_path / "forged.creds", "x", signed_by_stranger=True))
        for auth in (forged, NatsAuth()):
            with pytest.raises(NotConnected):
                await JetStreamBus(
                    short_config(server.url, subjects, auth=auth, connect_attempts=1)
                ).connect()
