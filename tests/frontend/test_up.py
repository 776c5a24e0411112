"""``shoal up`` as a user runs it: child processes, the official openai client, faults, Ctrl-C.

One cluster (embedded NATS, scheduler if built, two torch ``tiny`` agents, the
frontend) serves completions and chat; the scheduler is killed under a load of
concurrent streams (every stream completes: bypass); an agent is killed with
SIGKILL mid-stream (its streams complete through rescue, greedy text equal to
an undisturbed run); SIGINT then stops everything and leaves no process behind.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from bus.server import free_port
from tests.processes import alive
from tests.scrape import scrape, value

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PROMPT = "In a hole in the ground"


async def _stream(
    client: openai.AsyncOpenAI, max_tokens: int, started: asyncio.Event | None = None
) -> tuple[str, int]:
    stream = await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True})
    parts, usage = [], 0
    async for chunk in stream:
        if started is not None:
            started.set()
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        parts.extend(c.text for c in chunk.choices)
    return "".join(parts), usage


async def _metrics(port: int) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"http://127.0.0.1:{port}/metrics")).text


def _counter(metrics: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _start_up(port: int, tmp_path: Path) -> tuple[subprocess.Popen[str], dict[str, int], list[str]]:
    process = subprocess.Popen(
        [sys.executable, "-c", "from frontend.cli import main; main()", "up", "--instances", "2",
         "--model", "tiny", "--port", str(port), "--log-dir", str(tmp_path / "logs"),
         "--ready-timeout", "150"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    pids: dict[str, int] = {}
    lines: list[str] = []
    assert process.stdout is not None
    deadline = time.monotonic() + 170
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        found = re.search(r"^(\S+)\s+(?:(agent-\d+) )?pid (\d+)", line)
        if found:
            pids[found.group(2) or found.group(1)] = int(found.group(3))
        embedded = re.search(r"embedded, pid (\d+)", line)
        if embedded:
            pids["nats-server"] = int(embedded.group(1))
        if line.startswith("shoal is serving"):
            lines += [process.stdout.readline().rstrip(), process.stdout.readline().rstrip()]
            return process, pids, lines
    process.kill()
    process.stdout.close()
    raise AssertionError("shoal up did not become ready:\n" + "\n".join(lines))


async def test_shoal_up_serves_survives_faults_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    process, pids, lines = _start_up(port, tmp_path)
    try:
        assert any(line.strip().startswith("curl http://") for line in lines)
        assert {"nats-server", "agent-0", "agent-1", "frontend"} <= set(pids)
        async with openai.AsyncOpenAI(api_key="x", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0,
                                      timeout=120) as client:
            reference, usage = await _stream(client, 60)
            assert usage == 60
            chat = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
            assert chat.usage.completion_tokens == 8

            if "scheduler" in pids:  # kill the scheduler under a load of concurrent streams
                assert _counter(await _metrics(port), "shoal_scheduler_placements_total") >= 1
                load = [asyncio.ensure_future(_stream(client, 60)) for _ in range(8)]
                await asyncio.sleep(0.3)
                os.kill(pids["scheduler"], signal.SIGKILL)
                more = [asyncio.ensure_future(_stream(client, 60)) for _ in range(8)]
                results = await asyncio.wait_for(asyncio.gather(*load, *more), 120)
                assert all(r == (reference, 60) for r in results)
                assert _counter(await _metrics(port), "shoal_bypass_placements_total") >= 1

            started = [asyncio.Event() for _ in range(6)]
            streams = [asyncio.ensure_future(_stream(client, 400, event)) for event in started]
            for event in started:
                await event.wait()
            os.kill(pids["agent-0"], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*streams), 120)
            long_reference, _ = await _stream(client, 400)
            assert all(r == (long_reference, 400) for r in results)
            metrics = await _metrics(port)
            rescued = re.findall(r'^shoal_rescues_total\{cause="\w+"\} (\S+)$', metrics, re.MULTILINE)
            assert sum(float(v) for v in rescued) >= 1, metrics
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        finally:
            if process.stdout is not None:
                process.stdout.close()
    time.sleep(0.5)
    assert not [name for name, pid in pids.items() if alive(pid)]


async def _instances(http: httpx.AsyncClient, port: int) -> list[str]:
    return list((await http.get(f"http://127.0.0.1:{port}/health")).json()["instances"])


async def test_shoal_up_autoscale_starts_an_agent_under_load_and_drains_one_when_idle(tmp_path: Path) -> None:
    """--autoscale: the scheduler's instance manager adds an agent process, then scales back in."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", "from frontend.cli import main; main()", "up", "--engine", "sim",
         "--instances", "1", "--num-blocks", "16", "--time-scale", "30", "--port", str(port),
         "--log-dir", str(tmp_path / "logs"), "--autoscale", "--max-instances", "2",
         "--scale-band", "8", "15", "--scale-sustain", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    assert process.stdout is not None
    nats_url = ""
    try:
        for line in process.stdout:
            found = re.search(r"^nats-server\s+(\S+)", line)
            nats_url = found.group(1) if found else nats_url
            if line.startswith("shoal is serving"):
                break
        assert nats_url
        body = {"model": "sim:tiny-test", "prompt": "x" * 8, "max_tokens": 50, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=60) as http:
            assert await _instances(http, port) == ["agent-0"]

            async def keep_busy(until: asyncio.Event) -> None:
                while not until.is_set():
                    reply = await http.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
                    assert reply.status_code == 200

            grown = asyncio.Event()
            load = [asyncio.ensure_future(keep_busy(grown)) for _ in range(4)]  # freeness ~1 on 16 blocks
            deadline = time.monotonic() + 60
            while len(await _instances(http, port)) < 2:
                assert time.monotonic() < deadline, "no agent was added under load"
                await asyncio.sleep(0.2)
            assert "inst-0" in await _instances(http, port)
            grown.set()
            await asyncio.wait_for(asyncio.gather(*load), 60)
            deadline = time.monotonic() + 60
            while len(await _instances(http, port)) > 1:  # idle: freeness 16 > 15, one drains and leaves
                assert time.monotonic() < deadline, "the idle cluster did not scale back in"
                await asyncio.sleep(0.2)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        finally:
            process.stdout.close()
    time.sleep(0.5)
    leftovers = subprocess.run(["pgrep", "-f", "--", f"--nats {nats_url}"], capture_output=True,
                               text=True)
    assert nats_url and not leftovers.stdout.split(), "an agent outlived shoal up"


async def test_a_completion_sent_the_moment_shoal_up_says_serving_succeeds(tmp_path: Path) -> None:
    """The ready line means ready: no sleep, no retry between it and the first request."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", "from frontend.cli import main; main()", "up", "--engine", "sim",
         "--instances", "1", "--port", str(port), "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    assert process.stdout is not None
    lines: list[str] = []
    try:
        for line in process.stdout:
            lines.append(line.rstrip())
            if line.startswith("shoal is serving"):
                break
        assert lines and lines[-1].startswith("shoal is serving"), "\n".join(lines)
        base = f"http://127.0.0.1:{port}"
        body = {"model": "sim:tiny-test", "prompt": "hello", "max_tokens": 4}
        async with httpx.AsyncClient(timeout=30) as http:
            reply = await http.post(f"{base}/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 4
            health = await http.get(f"{base}/health")
            assert health.status_code == 200 and health.json()["states"] == {"agent-0": "ready"}
        endpoints = {line.split()[0]: line.split()[1] for line in lines
                     if line.split() and line.split()[0] in ("API", "health", "metrics")}
        assert endpoints == {"API": f"{base}/v1", "health": f"{base}/health", "metrics": f"{base}/metrics"}
        own = {found.group(1): found.group(2) for line in lines
               if (found := re.search(r"^(scheduler|agent)\s.*metrics (http://\S+)", line))}
        assert set(own) == {"scheduler", "agent"}, lines
        agent = await scrape(own["agent"])
        assert value(agent, "shoal_agent_step_duration_seconds_count") >= 1  # it ran our request
        scheduler = await scrape(own["scheduler"])
        assert sum(value(scheduler, "shoal_scheduler_role", role=r) for r in ("active", "standby",
                                                                              "starting", "taking_over")) == 1
        frontend = await scrape(endpoints["metrics"])
        for scraped in (agent, frontend, scheduler):  # start-up heaps frozen (bus/heap.py)
            assert value(scraped, "shoal_gc_frozen_objects") > 10_000
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        finally:
            process.stdout.close()


def test_up_does_not_call_another_servers_health_its_own(tmp_path: Path) -> None:
    """A foreign server on the port answers ``/health`` with "ok": ``shoal up`` says the port is taken
    and exits instead of printing that it serves."""
    import http.server
    import json
    import threading

    class Foreign(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"status": "ok", "instances": ["agent-0"], "states": {}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    foreign = http.server.HTTPServer(("127.0.0.1", 0), Foreign)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    try:
        done = subprocess.run(
            [sys.executable, "-c", "from frontend.cli import main; main()", "up", "--engine", "sim",
             "--instances", "1", "--no-scheduler", "--port", str(foreign.server_port),
             "--log-dir", str(tmp_path / "logs"), "--ready-timeout", "60"],
            capture_output=True, text=True, timeout=120,
        )
    finally:
        foreign.shutdown()
        foreign.server_close()
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "shoal is serving" not in output
    assert f"cannot serve on 127.0.0.1:{foreign.server_port}" in output, output
