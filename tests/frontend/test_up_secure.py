"""``shoal up --secure`` as a user runs it: every component on its own NATS user with mutual TLS.

The cluster serves a completion placed by the scheduler (so the frontend, the
scheduler and the agents each did their job under their role's permissions,
with no violation counted anywhere); a client without credentials, or with a
certificate but no user, is refused by the embedded server; Ctrl-C stops everything.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bus import BusConfig, JetStreamBus, NatsAuth, NotConnected
from bus.server import free_port
from tests.processes import alive
from tests.scrape import scrape, value

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


async def test_shoal_up_secure_serves_under_role_permissions_and_refuses_strangers(tmp_path: Path) -> None:
    port = free_port()
    log_dir = tmp_path / "logs"
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from frontend.cli import main; main()",
            "up",
            "--secure",
            "--engine",
            "sim",
            "--instances",
            "2",
            "--port",
            str(port),
            "--log-dir",
            str(log_dir),
            "--ready-timeout",
            "90",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    lines: list[str] = []
    pids: list[int] = []
    try:
        for line in process.stdout:
            lines.append(line.rstrip())
            pids += [int(p) for p in re.findall(r"pid (\d+)", line)]
            if line.startswith("shoal is serving"):
                break
        assert lines and lines[-1].startswith("shoal is serving"), "\n".join(lines)
        nats_url = re.search(r"^nats-server\s+(\S+)", "\n".join(lines), re.MULTILINE).group(1)  # type: ignore[union-attr]
        assert any("mutual TLS" in line for line in lines)
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(timeout=30) as http:
            reply = await http.post(
                f"{base}/v1/completions", json={"model": "sim:tiny-test", "prompt": "hello", "max_tokens": 4}
            )
            assert reply.status_code == 200, reply.text
        metrics = {
            found.group(1): found.group(2)
            for line in lines
            if (found := re.search(r"^(scheduler|agent\s+\S+)\s.*metrics (http://\S+)", line))
        }
        assert len(metrics) == 3, lines
        frontend = await scrape(f"{base}/metrics")
        assert value(frontend, "shoal_scheduler_placements_total") >= 1  # the scheduler placed it
        for scraped in [frontend, *[await scrape(url) for url in metrics.values()]]:
            for operation in ("publish", "subscribe"):
                assert value(scraped, "shoal_nats_permission_violations_total", operation=operation) == 0
        secure = log_dir / "nats-secure"
        strangers = [
            NatsAuth(tls_ca=secure / "ca.pem"),  # no user, no client certificate
            NatsAuth(
                tls_ca=secure / "ca.pem",
                tls_cert=secure / "client-observer.pem",
                tls_key=secure / "client-observer-key.pem",
            ),  # a certificate but no user
        ]
        for auth in strangers:
            with pytest.raises(NotConnected):
                await JetStreamBus(
                    BusConfig(url=nats_url, auth=auth, connect_attempts=1, connect_timeout=2.0)
                ).connect()
        observer = NatsAuth(
            nkey_seed=secure / "observer.nk",
            tls_ca=secure / "ca.pem",
            tls_cert=secure / "client-observer.pem",
            tls_key=secure / "client-observer-key.pem",
        )
        async with JetStreamBus(BusConfig(url=nats_url, auth=observer, provision=False, connect_attempts=1)):
            pass  # the observer connects
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        finally:
            process.stdout.close()
    time.sleep(0.5)
    assert pids and not [pid for pid in pids if alive(pid)]
