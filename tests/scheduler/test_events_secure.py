"""``shoal events`` reads a secured cluster's log as the observer user, and is refused without one."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from scheduler.events_cli import events
from tests.conftest import SecureNats


def _env(secure: SecureNats, user: str | None) -> dict[str, str]:
    deployment = secure.deployment
    env = {"SHOAL_NATS_URL": secure.url, "SHOAL_NATS_TLS_CA": str(deployment.ca_file)}
    if user is not None:
        identity = deployment.identities[user]
        env |= {
            "SHOAL_NATS_NKEY_SEED": str(identity.seed_file),
            "SHOAL_NATS_TLS_CERT": str(identity.cert_file),
            "SHOAL_NATS_TLS_KEY": str(identity.key_file),
        }
    return env


def test_events_export_as_the_observer(secure_nats: SecureNats, tmp_path: Path) -> None:
    prefix = secure_nats.subjects.prefix
    out = tmp_path / "log.jsonl"
    result = CliRunner().invoke(
        events, ["export", "--prefix", prefix, "--out", str(out)], env=_env(secure_nats, "observer")
    )
    assert result.exit_code == 0, result.output
    assert out.exists()
    refused = CliRunner().invoke(
        events,
        ["export", "--prefix", prefix, "--out", str(tmp_path / "no.jsonl")],
        env=_env(secure_nats, None),
    )
    assert refused.exit_code != 0
    assert "cannot" in refused.output and "as none" in refused.output
