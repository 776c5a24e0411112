"""``shoal agent`` as a user runs it: a subprocess that serves, streams, has /metrics, leaves on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from agents.engines.sim import sim_token_id
from schemas import GenerateRequest, InstanceJoined, InstanceLeft
from tests.agents.agent_cluster import agent_cluster, greedy
from tests.scrape import scrape, value


async def test_shoal_agent_serves_and_leaves_cleanly(nats_url: str, tmp_path: Path) -> None:
    async with agent_cluster(nats_url) as cluster:
        ready = tmp_path / "ready.json"
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "from frontend.cli import main; main()",
            "agent",
            "--engine",
            "sim",
            "--nats",
            nats_url,
            "--prefix",
            cluster.subjects.prefix,
            "--instance-id",
            "cli1",
            "--transport",
            "tcp",
            "--ready-file",
            str(ready),
            "--metrics-port",
            "0",
            "--log-level",
            "WARNING",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            async with asyncio.timeout(30):
                while not ready.exists():
                    await asyncio.sleep(0.05)
            info = json.loads(ready.read_text())
            assert info["instance_id"] == "cli1" and info["transport_address"].startswith("tcp://")
            watcher = await cluster.watch("c1")
            reply = await cluster.generate(
                "cli1", GenerateRequest(request_id="c1", token_ids=(1, 2, 3), sampling=greedy(10))
            )
            assert reply.accepted
            await watcher.wait_finished()
            assert watcher.tokens() == [sim_token_id("c1", None, i, 1000, 0) for i in range(10)]
            await watcher.close()
            samples = await scrape(info["metrics_url"])  # --metrics-port 0: a free port, in the ready file
            assert value(samples, "shoal_agent_step_duration_seconds_count") >= 10
            assert value(samples, "shoal_agent_kv_blocks") > 0
        finally:
            process.send_signal(signal.SIGTERM)
            output, _ = await asyncio.wait_for(process.communicate(), 20)
        assert process.returncode == 0, output.decode()
        events = [env.body for _, env in await cluster.stored(cluster.subjects.instance("cli1"))]
        assert isinstance(events[0], InstanceJoined) and events[0].engine == "sim"
        assert isinstance(events[-1], InstanceLeft)
