"""API keys: read from a file or the environment, compared in constant time, never shown."""

from __future__ import annotations

import hmac
from pathlib import Path

import pytest
from click.testing import CliRunner

from frontend import api_keys
from frontend.api_keys import key_matches, read_key_file
from frontend.cli_serve import _api_keys, serve
from frontend.config import FrontendConfig
from tests.frontend.cluster import frontend_cluster


def test_every_configured_key_is_compared_with_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    original = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return original(a, b)

    monkeypatch.setattr(api_keys.hmac, "compare_digest", counting)
    assert key_matches("k1", ("k1", "k2", "k3"))  # a match on the first key does not stop the loop
    assert len(calls) == 3
    assert not key_matches("k", ("k1", "k2"))
    assert not key_matches("", ("k1",))


def test_keys_from_a_file_and_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "keys"
    path.write_text("# the team's keys\nalpha\n\n  beta  \n")
    assert read_key_file(path) == ("alpha", "beta")
    assert _api_keys(("gamma",), path) == ("gamma", "alpha", "beta")
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no API key"):
        read_key_file(empty)
    seen: dict[str, object] = {}

    def capture(options: dict[str, object]) -> FrontendConfig:
        seen.update(options)
        raise SystemExit(0)  # told what it needs: serve nothing

    monkeypatch.setattr("frontend.cli_serve.config_from_options", capture)
    monkeypatch.setenv("SHOAL_API_KEY", "k1 k2")
    monkeypatch.setenv("SHOAL_API_KEY_FILE", str(path))
    result = CliRunner().invoke(serve, [])
    assert result.exit_code == 0, result.output
    assert seen["api_key"] == ("k1", "k2") and seen["api_key_file"] == path


def test_keys_never_appear_in_the_config_repr() -> None:
    assert "hunter2" not in repr(FrontendConfig(api_keys=("hunter2",)))


async def test_a_wrong_key_is_refused_without_echoing_any_key(nats_url: str) -> None:
    async with (
        frontend_cluster(nats_url, instances=1, api_keys=("s3cret-key",)) as cluster,
        cluster.client() as client,
    ):
        body = {"model": "sim:tiny-test", "prompt": "hi", "max_tokens": 2}
        denied = await client.post(
            "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret-ke"}
        )
        assert denied.status_code == 401
        assert "s3cret" not in denied.text
        ok = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret-key"})
        assert ok.status_code == 200


def test_shoal_serve_takes_the_generate_timeout_and_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    from frontend import cli_serve

    made: list[FrontendConfig] = []
    real = cli_serve.config_from_options

    def capture(options: dict[str, object]) -> FrontendConfig:
        made.append(real(options))
        raise SystemExit(0)

    monkeypatch.setattr("frontend.cli_serve.config_from_options", capture)
    result = CliRunner().invoke(serve, ["--generate-timeout", "0.5", "--generate-retries", "0"])
    assert result.exit_code == 0, result.output
    assert (made[0].generate_timeout, made[0].generate_retries) == (0.5, 0)
    assert (FrontendConfig().generate_timeout, FrontendConfig().generate_retries) == (2.0, 2)
    refused = CliRunner().invoke(serve, ["--generate-retries", "-1"])
    assert refused.exit_code == 2 and "--generate-retries" in refused.output
