"""``shoal replay --what-if-policy P --simulate``: a recorded sim-engine run through the simulator.

A real cluster (sim agents, a frontend, a scheduler on a real nats-server) serves a burst of
requests of varied lengths; its exported log drives the simulator under the recorded policy and
under another. The report holds every recorded request, the recorded and simulated percentiles with
the error between them, and the other policy's prediction; bad uses are clear errors.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from frontend.cli import cli
from scheduler.service import SchedulerConfig, SchedulerService
from tests.frontend.cluster import frontend_cluster
from tests.scheduler.service_helpers import connected

pytestmark = pytest.mark.slow

NUM_REQUESTS = 40


async def _shoal(*args: str, code: int = 0) -> str:
    result = await asyncio.to_thread(CliRunner().invoke, cli, list(args))
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture(scope="module")
async def recorded(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("whatif") / "cluster.log"
    rng = random.Random(5)
    async with frontend_cluster(nats_url, instances=2, engine_options={"time_scale": 5.0}) as cluster:
        async with connected(nats_url, cluster.subjects.prefix) as sched_bus:
            service = SchedulerService(sched_bus, SchedulerConfig(lease_ttl_s=1.0, pairing_interval_s=0.2))
            task = asyncio.create_task(service.run())
            try:
                await service.wait_active(10)
                async with cluster.client() as client:
                    calls = []
                    for _ in range(NUM_REQUESTS):
                        body = {
                            "model": "sim:tiny-test",
                            "prompt": [rng.randrange(3, 200) for _ in range(rng.choice([8, 32, 64]))],
                            "max_tokens": rng.choice([8, 24, 48]),
                            "temperature": 0,
                        }
                        calls.append(asyncio.ensure_future(client.post("/v1/completions", json=body)))
                        await asyncio.sleep(rng.expovariate(40.0))
                    responses = await asyncio.gather(*calls)
                assert all(r.status_code == 200 for r in responses)
                await asyncio.sleep(0.3)  # the lifecycle events are appended
            finally:
                await service.stop()
                await asyncio.wait_for(task, 10)
        await _shoal(
            "events", "export", "--nats", nats_url, "--prefix", cluster.subjects.prefix, "--out", str(path)
        )
    return path


async def test_simulated_what_if_reports_recorded_simulated_and_predicted(recorded: Path) -> None:
    report = json.loads(
        await _shoal(
            "replay", "--file", str(recorded), "--what-if-policy", "round_robin", "--simulate", "--json"
        )
    )
    assert report["num_requests"] == NUM_REQUESTS and report["num_instances"] == 2
    assert report["profile"] == "tiny-test" and report["time_scale"] > 0
    assert (
        report["recorded"]["policy"] == "freeness" and report["recorded"]["latency"]["count"] == NUM_REQUESTS
    )
    assert report["simulated_recorded"]["latency"]["count"] == NUM_REQUESTS
    assert report["simulated_what_if"]["policy"] == "round_robin"
    assert report["simulated_what_if"]["latency"]["count"] == NUM_REQUESTS
    # the calibration makes the simulated median TPOT the recorded one (up to queueing effects)
    tpot = report["errors"]["tpot_p50"]
    assert abs(tpot) < 0.5, report["errors"]
    assert set(report["errors"]) >= {"ttft_p50", "ttft_p99", "tpot_p99", "e2e_p99"}
    text = await _shoal("replay", "--file", str(recorded), "--what-if-policy", "round_robin", "--simulate")
    assert "TTFT P99" in text and "error" in text and "sim round_robin" in text


async def test_the_default_policy_can_be_predicted(recorded: Path) -> None:
    report = json.loads(
        await _shoal(
            "replay", "--file", str(recorded), "--what-if-policy", "prefill_ahead", "--simulate", "--json"
        )
    )
    assert report["simulated_what_if"]["policy"] == "prefill_ahead"
    assert report["simulated_what_if"]["latency"]["count"] == NUM_REQUESTS


async def test_bad_what_if_uses_are_clear_errors(recorded: Path) -> None:
    text = await _shoal("replay", "--file", str(recorded), "--simulate", code=2)
    assert "--simulate needs --what-if-policy" in text
    text = await _shoal(
        "replay", "--file", str(recorded), "--simulate", "--what-if-policy", "infaas++",
        "--from", "2000-01-01T00:00:00", "--to", "2000-01-01T00:01:00", code=1,
    )  # fmt: skip
    assert "no request arrived in the log's window" in text
    text = await _shoal("replay", "--file", str(recorded), "--to", "2000-01-01T00:01:00", code=2)
    assert "--to ends the --simulate window" in text
