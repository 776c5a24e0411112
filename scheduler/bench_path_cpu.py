"""The serving path's CPU per request per process, on ``sim`` agents (``python -m scheduler.bench_path_cpu``).

Starts a nats-server with its monitoring port and ``shoal up --engine sim --nats URL`` (from
``--checkout``, so two checkouts can be compared with one harness, alternating runs), streams a
warm-up, then per round ``--requests`` ``/v1/completions`` requests (``--prompt-tokens`` token ids,
``--max-tokens`` with ``ignore_eos``) from ``--concurrency`` aiohttp clients and prints one JSON line:
CPU milliseconds per request (user + system from ``/proc/<pid>/stat``, and the system part apart) of
the frontend, the scheduler, the agent and nats-server; the messages nats-server took in and sent
out per request (``/varz``) and per client connection (``/connz``); the median time to first
token. ``--subjects`` also counts the messages per subject pattern (a subscriber to ``>``: it sees a
JetStream append twice, as published and as delivered to the scheduler, and adds its own load, so
its rounds are not CPU figures). The sim engine's step is part of the agent's figure. Not a test:
numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from bus.server import find_nats_server
from scheduler.bench_cluster import process_cpu_seconds

__all__ = ["main"]

_TICK = os.sysconf("SC_CLK_TCK")
_ROLES = (("scheduler", "scheduler"), (" agent", "agent"), (" serve", "frontend"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _system_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[12]) / _TICK


def _children(parent: int) -> dict[int, str]:
    """The direct children of ``parent`` by role (frontend, scheduler, agent)."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            command = Path(f"/proc/{entry}/cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        if ppid == parent:
            found[int(entry)] = next((role for key, role in _ROLES if key in command), command[:40])
    return found


def _monitor(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{path}", timeout=5) as response:
        data: dict[str, Any] = json.load(response)
    return data


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int
) -> float:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.perf_counter()
    first: float | None = None
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if first is None and line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                first = time.perf_counter() - started
    return started if first is None else first


async def _drive(url: str, model: str, args: argparse.Namespace, offset: int, count: int) -> float:
    """``count`` streamed requests from ``--concurrency`` clients; the median time to first token."""
    gate = asyncio.Semaphore(args.concurrency)
    ttfts: list[float] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(index: int) -> None:
            prompt = [((offset + index) * 7919 + j * 31) % 200 + 20 for j in range(args.prompt_tokens)]
            async with gate:
                ttfts.append(await _one(session, url, model, prompt, args.max_tokens))

        await asyncio.gather(*(one(i) for i in range(count)))
    return statistics.median(ttfts)


async def _count_subjects(url: str, stop: asyncio.Event, counts: collections.Counter[str]) -> None:
    import nats

    connection = await nats.connect(url, name="subject-counter")

    async def on_message(msg: Any) -> None:
        subject = re.sub(r"_INBOX\..*|\$JS\.ACK\..*", "<reply>", msg.subject)
        counts[re.sub(r"^(\w+\.(ev\.req|tok|tokb))\..*", r"\1.<id>", subject)] += 1

    await connection.subscribe(">", cb=on_message)
    await stop.wait()
    await connection.drain()


async def _round(
    url: str,
    nats_url: str,
    model: str,
    args: argparse.Namespace,
    offset: int,
    counts: collections.Counter[str],
) -> float:
    stop = asyncio.Event()
    counter = asyncio.create_task(_count_subjects(nats_url, stop, counts)) if args.subjects else None
    await asyncio.sleep(0.3)
    ttft = await _drive(url, model, args, offset, args.requests)
    await asyncio.sleep(0.5)  # the last appends and their deliveries
    stop.set()
    if counter is not None:
        await counter
    return ttft


def _measure(
    args: argparse.Namespace,
    processes: dict[int, str],
    monitor: int,
    url: str,
    nats_url: str,
    model: str,
    offset: int,
) -> dict[str, Any]:
    cpu0 = {pid: process_cpu_seconds(pid) for pid in processes}
    sys0 = {pid: _system_seconds(pid) for pid in processes}
    varz0, connz0 = _monitor(monitor, "varz"), _monitor(monitor, "connz?limit=1000")
    counts: collections.Counter[str] = collections.Counter()
    ttft = asyncio.run(_round(url, nats_url, model, args, offset, counts))
    per = 1e3 / args.requests
    varz1, connz1 = _monitor(monitor, "varz"), _monitor(monitor, "connz?limit=1000")
    before = {c["cid"]: c for c in connz0["connections"]}
    connections = {}
    for c in connz1["connections"]:
        if c.get("name") == "subject-counter":
            continue
        old = before.get(c["cid"], {"in_msgs": 0, "out_msgs": 0})
        connections[c.get("name") or str(c["cid"])] = [
            round((c["in_msgs"] - old["in_msgs"]) / args.requests, 2),
            round((c["out_msgs"] - old["out_msgs"]) / args.requests, 2),
        ]
    row: dict[str, Any] = {
        "cpu_ms_per_request": {
            processes[p]: round((process_cpu_seconds(p) - cpu0[p]) * per, 3) for p in processes
        },
        "system_ms_per_request": {
            processes[p]: round((_system_seconds(p) - sys0[p]) * per, 3) for p in processes
        },
        "nats_in_msgs_per_request": round((varz1["in_msgs"] - varz0["in_msgs"]) / args.requests, 2),
        "nats_out_msgs_per_request": round((varz1["out_msgs"] - varz0["out_msgs"]) / args.requests, 2),
        "connection_in_out_msgs_per_request": connections,
        "ttft_p50_ms": round(ttft * 1e3, 1),
    }
    if args.subjects:
        row["subject_msgs_per_request"] = {k: round(v / args.requests, 2) for k, v in counts.most_common(30)}
    return row


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="bench-path-cpu-"))
    port, monitor, http = _free_port(), _free_port(), _free_port()
    nats_url, url, model = f"nats://127.0.0.1:{port}", f"http://127.0.0.1:{http}", f"sim:{args.profile}"
    nats_server = subprocess.Popen(
        [
            find_nats_server(),
            "-js",
            "-a",
            "127.0.0.1",
            "-p",
            str(port),
            "-m",
            str(monitor),
            "-sd",
            str(work / "js"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    checkout = str(Path(args.checkout).resolve())
    command = [
        sys.executable,
        "-c",
        "from frontend.cli import main; main()",
        "up",
        "--engine",
        "sim",
        "--model",
        args.profile,
        "--instances",
        str(args.instances),
        "--nats",
        nats_url,
        "--port",
        str(http),
        "--log-dir",
        str(work / "logs"),
    ]
    if args.no_scheduler:
        command.append("--no-scheduler")
    with open(work / "up.log", "w") as log_file:
        up = subprocess.Popen(
            command,
            cwd=checkout,
            env={**os.environ, "PYTHONPATH": checkout},
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    rows: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1).close()
                break
            except OSError as exc:
                if time.monotonic() > deadline or up.poll() is not None:
                    raise RuntimeError(f"shoal up did not serve in 180 s (log: {work / 'up.log'})") from exc
                time.sleep(0.5)
        time.sleep(2)
        asyncio.run(_drive(url, model, args, 100_000, 2 * args.concurrency))  # warm-up
        processes = _children(up.pid)
        processes[nats_server.pid] = "nats"
        for index in range(args.rounds):
            time.sleep(1)
            row = _measure(args, processes, monitor, url, nats_url, model, index * args.requests)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
        nats_server.terminate()
        nats_server.wait(10)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--checkout", default=".", help="Run shoal from this checkout.")
    parser.add_argument("--profile", default="llama-3.1-8b-h100", help="sim engine profile.")
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--no-scheduler", action="store_true", help="shoal up --no-scheduler (bypass placement)."
    )
    parser.add_argument("--subjects", action="store_true", help="Also count messages per subject.")
    rows = run(parser.parse_args())
    if len(rows) > 1:
        keys = rows[0]["cpu_ms_per_request"]
        medians = {k: round(statistics.median(r["cpu_ms_per_request"][k] for r in rows), 3) for k in keys}
        print(json.dumps({"median_cpu_ms_per_request": medians}))


if __name__ == "__main__":
    main()
