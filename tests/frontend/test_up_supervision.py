"""``shoal up`` heals its cluster: killed components come back by themselves, and a request that no
instance can take ends with an error within the rescue bound instead of hanging.

* Every agent killed with SIGKILL under streamed load (sim engine, two instances, paced so the
  streams are in flight; agents restart later than the rescue bound): each stream ends with an
  SSE error event then ``[DONE]``, within the bound; the agents are restarted under their own ids
  and serve again; a request sent afterwards completes.
* The scheduler killed with SIGKILL under streamed load: the streams complete (bypass); it is
  restarted, recovers from the log and places requests again.
* A scheduler killed again right after its restart (``--restart-limit 2``) is left down; the agents
  serve on and ``/health`` names it with its exit signal.
* Agents whose engine dies at its first step (a hidden fault option): none becomes ready;
  ``shoal up`` reports the crash loop (the exit signal, the log's last lines) and exits non-zero.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from bus.server import free_port
from tests.processes import alive

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MODEL = "sim:tiny-test"
#: the frontend gives up on a request whose instance died after this long without another one
RESCUE_TIMEOUT_S = 3.0
#: the supervisor waits this long before restarting a killed child: longer than the rescue bound,
#: so a stream in flight meets the error, not a restarted agent
RESTART_DELAY_S = 20.0


class Up:
    """A ``shoal up`` process whose output lines are collected as they come."""

    def __init__(self, args: list[str], log_dir: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from frontend.cli import main; main()", "up", *args,
             "--log-dir", str(log_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip())

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, pattern: str, timeout_s: float) -> re.Match[str]:
        """The first output line matching ``pattern``; fails after ``timeout_s`` or if shoal up ended."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if found := re.search(pattern, line):
                    return found
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s}s:\n{self.output}")

    def pid(self, name: str) -> int:
        found = self.wait_line(rf"^(?:agent\s+)?{name}\s+pid (\d+)", 5)
        return int(found.group(1))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._reader.join(10)
        if self.process.stdout is not None:
            self.process.stdout.close()


def _restarted_pids(up: Up, name: str) -> list[int]:
    pattern = rf"^{name} restarted \(pid (\d+)\)"
    return [int(m.group(1)) for line in list(up.lines) if (m := re.search(pattern, line))]


async def _stream(http: httpx.AsyncClient, url: str, max_tokens: int,
                  started: asyncio.Event | None = None) -> tuple[list[dict[str, object]], bool, float]:
    """A streamed completion: its SSE payloads (``[DONE]`` left out), whether ``[DONE]`` ended it, and
    the monotonic time it ended."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    payloads: list[dict[str, object]] = []
    done = False
    async with http.stream("POST", f"{url}/v1/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            payloads.append(json.loads(data))
            if started is not None:
                started.set()
    return payloads, done, time.monotonic()


def _text(payloads: list[dict[str, object]]) -> str:
    return "".join(str(c.get("text", "")) for p in payloads for c in p.get("choices", []) or [])  # type: ignore[union-attr]


async def _ready(http: httpx.AsyncClient, url: str) -> list[str]:
    try:
        return list((await http.get(f"{url}/health")).json()["instances"])
    except (httpx.HTTPError, ValueError, KeyError):
        return []


async def _wait_ready(http: httpx.AsyncClient, url: str, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while len(await _ready(http, url)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} instances ready within {timeout_s}s"
        await asyncio.sleep(0.2)


def _cluster_args(port: int) -> list[str]:
    # --time-scale 60: sim steps of tens of milliseconds, so a 200-token stream runs for seconds
    return ["--engine", "sim", "--instances", "2", "--time-scale", "60", "--port", str(port),
            "--rescue-timeout", str(RESCUE_TIMEOUT_S), "--restart-delay", str(RESTART_DELAY_S),
            "--restart-max-delay", str(RESTART_DELAY_S), "--ready-timeout", "120"]


async def test_every_agent_killed_streams_end_with_the_error_within_the_bound_and_the_agents_come_back(
    tmp_path: Path,
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = Up(_cluster_args(port), tmp_path / "logs")
    try:
        up.wait_line(r"^shoal is serving", 150)
        agents = {name: up.pid(name) for name in ("agent-0", "agent-1")}
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0)) as http:
            started = [asyncio.Event() for _ in range(4)]
            streams = [asyncio.ensure_future(_stream(http, url, 200, event)) for event in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            killed_at = time.monotonic()
            for pid in agents.values():
                os.kill(pid, signal.SIGKILL)
            # bounded here only so a hang fails the test: the frontend's own bound ends them first
            results = await asyncio.wait_for(asyncio.gather(*streams), RESTART_DELAY_S + 60)
            for payloads, done, ended_at in results:
                assert done, "the stream did not end with [DONE]"
                error = payloads[-1].get("error")
                assert isinstance(error, dict), payloads[-3:]
                assert "rescue timeout" in str(error.get("message")), error
                # within the bound (the frontend notices the silence, then rescues for the bound), long
                # before the supervisor starts an agent again: the error is the bound's, not a hang
                assert ended_at - killed_at < RESTART_DELAY_S, ended_at - killed_at
            # nothing left running the streams: a new request is refused at once
            reply = await http.post(f"{url}/v1/completions",
                                    json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
            assert reply.status_code == 503, reply.text

            for name, pid in agents.items():  # the supervisor restarts each under its own id
                up.wait_line(rf"^{name} \(pid {pid}\) exited with SIGKILL", 10)
            await _wait_ready(http, url, 2, RESTART_DELAY_S + 90)
            assert sorted(await _ready(http, url)) == ["agent-0", "agent-1"]
            for name, pid in agents.items():
                [new_pid] = _restarted_pids(up, name)
                assert new_pid != pid and alive(new_pid)

            body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "ignore_eos": True}
            reply = await http.post(f"{url}/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 8
            payloads, done, _ = await _stream(http, url, 20)
            assert done and "error" not in payloads[-1] and len(_text(payloads).encode()) > 0
    finally:
        up.stop()
    assert up.process.returncode == 0, up.output


def _frontend_counter(metrics: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def _placements(http: httpx.AsyncClient, url: str) -> float:
    """Requests the frontend placed through the scheduler so far."""
    return _frontend_counter((await http.get(f"{url}/metrics")).text, "shoal_scheduler_placements_total")


async def test_the_scheduler_killed_requests_bypass_it_and_it_comes_back_and_places_again(
    tmp_path: Path,
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = _cluster_args(port)
    args[args.index("--restart-delay") + 1] = "1"  # the scheduler comes back soon
    up = Up(args, tmp_path / "logs")
    try:
        up.wait_line(r"^shoal is serving", 150)
        scheduler = up.pid("scheduler")
        async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=10.0)) as http:
            await _stream(http, url, 4)
            placed = await _placements(http, url)
            assert placed >= 1
            load = [asyncio.ensure_future(_stream(http, url, 100)) for _ in range(4)]
            await asyncio.sleep(0.3)
            os.kill(scheduler, signal.SIGKILL)
            more = [asyncio.ensure_future(_stream(http, url, 100)) for _ in range(4)]
            for payloads, done, _ in await asyncio.wait_for(asyncio.gather(*load, *more), 120):
                assert done and "error" not in payloads[-1], payloads[-1]
                assert len(_text(payloads).encode()) > 0
            metrics = (await http.get(f"{url}/metrics")).text
            assert _frontend_counter(metrics, "shoal_bypass_placements_total") >= 1

            up.wait_line(rf"^scheduler \(pid {scheduler}\) exited with SIGKILL", 10)
            up.wait_line(r"^scheduler restarted \(pid \d+\)", 30)
            [new_pid] = _restarted_pids(up, "scheduler")
            assert alive(new_pid)
            log_path = tmp_path / "logs" / "scheduler.log"
            deadline = time.monotonic() + 60
            while "active at epoch 2" not in log_path.read_text():  # it took the lease over, from the log
                assert time.monotonic() < deadline, log_path.read_text()[-2000:]
                await asyncio.sleep(0.2)
            # the restarted scheduler took over from the log: requests are placed by it again
            placed = await _placements(http, url)
            deadline = time.monotonic() + 60
            while True:
                payloads, done, _ = await _stream(http, url, 4)
                assert done and "error" not in payloads[-1]
                if await _placements(http, url) > placed:
                    break
                assert time.monotonic() < deadline, "the restarted scheduler placed no request within 60s"
                await asyncio.sleep(0.5)
    finally:
        up.stop()
    assert up.process.returncode == 0, up.output


def test_agents_that_die_at_their_first_step_are_left_down_and_shoal_up_says_why(tmp_path: Path) -> None:
    port = free_port()
    up = Up(["--engine", "sim", "--instances", "2", "--port", str(port), "--fault-first-step", "exit",
             "--restart-delay", "0.5", "--restart-limit", "2", "--ready-timeout", "60"], tmp_path / "logs")
    ever_ready: set[str] = set()
    try:
        deadline = time.monotonic() + 120
        while up.process.poll() is None:  # while it tries: no instance is ever ready
            assert time.monotonic() < deadline, f"shoal up did not give up within 120s:\n{up.output}"
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).json()
                ever_ready.update(health["instances"])
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.2)
    finally:
        up.stop()
    output = up.output
    assert up.process.returncode != 0, output
    assert ever_ready == set(), output
    assert "shoal is serving" not in output
    assert "no instance became ready" in output, output
    for name in ("agent-0", "agent-1"):
        crash_loop = rf"{name} exited 2 times within 60s, last with SIGILL \(illegal instruction"
        assert re.search(crash_loop, output), output
        log = tmp_path / "logs" / f"{name}.log"
        lines = log.read_text().splitlines()
        if lines:  # the log's tail is shown
            assert f"last lines of {log}:" in output and f"  | {lines[-1]}" in output, output
        else:
            assert f"{log} is empty" in output, output


async def test_a_scheduler_that_keeps_dying_is_left_down_and_health_says_why(tmp_path: Path) -> None:
    """Two SIGKILLs within the window at --restart-limit 2: the scheduler is left down, the agents serve
    on (bypass), and ``/health`` names it with its signal."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = Up(["--engine", "sim", "--instances", "1", "--port", str(port), "--restart-delay", "1",
             "--restart-limit", "2", "--ready-timeout", "120"], tmp_path / "logs")
    try:
        up.wait_line(r"^shoal is serving", 150)
        first = up.pid("scheduler")
        os.kill(first, signal.SIGKILL)
        second = int(up.wait_line(r"^scheduler restarted \(pid (\d+)\)", 30).group(1))
        os.kill(second, signal.SIGKILL)
        up.wait_line(r"^scheduler exited 2 times within 60s, last with SIGKILL", 30)
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0)) as http:
            health = await http.get(f"{url}/health")
            assert health.status_code == 200, health.text  # the agent still serves
            reason = health.json()["left_down"]["scheduler"]
            assert "SIGKILL (killed, perhaps by the OOM killer)" in reason and "left down" in reason
            payloads, done, _ = await _stream(http, url, 8)
            assert done and "error" not in payloads[-1]
        await asyncio.sleep(3)  # the supervisor's policy: nothing starts it again
        assert _restarted_pids(up, "scheduler") == [second]
    finally:
        up.stop()
    assert up.process.returncode == 0, up.output
