"""Choosing a transport: ``auto`` prefers UCX and falls back to TCP, saying so in the log."""

from __future__ import annotations

import logging

import pytest

import transport.ucx
from tests.transport.conftest import skip_without_ucx
from transport import (
    TransferHeader,
    TransportConfig,
    TransportError,
    TransportUnavailable,
    create_transport,
    open_transport,
)
from transport.bench import format_results, measure_bandwidth


async def test_auto_falls_back_to_tcp_with_a_warning_when_ucx_is_missing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(transport.ucx, "ucx_available", lambda: "ucxx cannot be imported: ImportError: test")
    with caplog.at_level(logging.WARNING, logger="transport.factory"):
        chosen = await open_transport(TransportConfig(kind="auto"))
    try:
        assert chosen.kind == "tcp"
        assert chosen.address.startswith("tcp://127.0.0.1:")
    finally:
        await chosen.close()
    assert any(
        "falling back to TCP" in r.getMessage() and "ImportError" in r.getMessage() for r in caplog.records
    )
    with pytest.raises(TransportUnavailable, match="ImportError"):
        create_transport(TransportConfig(kind="ucx"))


async def test_auto_falls_back_when_ucx_fails_to_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    skip_without_ucx("ucx")

    def broken_runtime(config: TransportConfig) -> object:
        raise TransportUnavailable("UCX failed to initialise: no usable transports")

    monkeypatch.setattr(transport.ucx, "_acquire_runtime", broken_runtime)
    with caplog.at_level(logging.WARNING, logger="transport.factory"):
        chosen = await open_transport(TransportConfig(kind="auto"))
    await chosen.close()
    assert chosen.kind == "tcp"
    assert any("no usable transports" in r.getMessage() for r in caplog.records)


async def test_auto_picks_ucx_when_it_works() -> None:
    skip_without_ucx("ucx")
    chosen = await open_transport(TransportConfig(kind="auto", ucx_tls="tcp"))
    try:
        assert chosen.kind == "ucx"
        assert chosen.address.startswith("ucx://127.0.0.1:")
    finally:
        await chosen.close()


async def test_ucx_transports_in_one_process_must_share_their_options() -> None:
    skip_without_ucx("ucx")
    first = create_transport(TransportConfig(kind="ucx", ucx_tls="tcp"))
    second = create_transport(
        TransportConfig(kind="ucx", ucx_tls="tcp", ucx_options=(("RNDV_THRESH", "1m"),))
    )
    await first.start()
    try:
        with pytest.raises(TransportError, match="cannot run beside it"):
            await second.start()
    finally:
        await first.close()


async def test_a_transport_cannot_send_to_another_kinds_address() -> None:
    tcp = await open_transport(TransportConfig(kind="tcp"))
    try:
        with pytest.raises(TransportError):
            await tcp.send("inproc://x", TransferHeader(migration_id="m", stage=0, nbytes=1), b"x")
    finally:
        await tcp.close()


@pytest.mark.parametrize("kind", ["inproc", "tcp", "ucx"])
async def test_the_bandwidth_helper_measures_each_kind(kind: str) -> None:
    skip_without_ucx(kind)
    config = TransportConfig(kind=kind, ucx_tls="tcp")  # type: ignore[arg-type]
    results = await measure_bandwidth(config, sizes=(4096, 1 << 20), repeats=2)
    assert [(r.kind, r.nbytes) for r in results] == [(kind, 4096), (kind, 1 << 20)]
    assert all(r.median_gbps > 0 for r in results)
    assert kind in format_results(results)
