"""``shoal bench cluster``: the scheduler under load at 64 ``sim`` instances.

Starts (unless ``--nats`` is given) an embedded nats-server, a ``shoal
scheduler`` process and ``--processes`` processes of ``sim`` agents
(:mod:`agents.bench_fleet`, ``--instances`` in all, LLaMA-7B/A10 timing),
then for each rate runs an open-loop load generator for ``--duration``
seconds: each request (prompt 128 tokens, output 32) asks the scheduler for a
placement and sends a ``GenerateRequest`` with ``stream=False`` to the chosen
agent, so agents publish one message per finished request, not one per
token. Per rate it reports:

* ``dispatch_p50_ms`` / ``dispatch_p99_ms``: request sent to the scheduler until
  the agent accepted it (``scheduler_rpc_*``: the scheduler's reply alone;
  ``scheduler_inbound_*``: sent until the scheduler's handler started;
  ``scheduler_decision_*``: the handler's own time, folding and deciding);
* ``scheduler_cpu``: the scheduler process's CPU time over wall time (1.0 = one core);
* ``scheduler_cpu_ms_per_request`` / ``generator_cpu_ms_per_request`` /
  ``nats_cpu_ms_per_request``: CPU time (user + system, from ``/proc``) per request
  of the scheduler, of this process (the load generator: the frontend's part)
  and of the embedded nats-server: robust on a shared machine, where latencies
  are not;
* ``scheduler_writes_per_request`` / ``scheduler_reads_per_request``: the
  scheduler's write and read system calls per request (``/proc/<pid>/io``),
  ``scheduler_system_share``: the kernel's share of its CPU time;
* ``append_eps``: appends per second to both streams (``events_eps``, ``loads_eps`` apart);
* ``agent_step_lag_p99_ms``: how late agents' steps complete against their
  modeled schedule (a late step starts the next one late).

A last phase at the highest rate runs with the scheduler stopped (the load
generator places round-robin itself, as a frontend's bypass would) for the
step-lag baseline. Numbers depend on the machine; on a shared 2-core machine
everything (NATS, scheduler, agents, load generator) competes for the cores.

``--repeats N`` runs all the phases N times in turn, side by side on the same
machine: after each phase without the scheduler a new ``shoal scheduler``
starts, recovers from the log and places a probe before the next phase; every
row carries its ``repeat`` and each phase gets a row of medians
(``"repeat": "median"``), which is what the table shows.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from bus import BusConfig, JetStreamBus, event_loop
from bus.bench_progress import BenchProgress
from bus.errors import BusError
from bus.options import nats_option
from bus.server import EmbeddedNats
from scheduler.service import SENT_HEADER
from schemas import Codec, Subjects
from schemas.instance import InstanceJoined
from schemas.rpc import DispatchReply, DispatchRequest, GenerateReply, GenerateRequest, SamplingParams

__all__ = ["bench_cluster", "process_cpu_seconds", "process_syscalls", "run_cluster_bench"]

PROMPT_TOKENS = 128
OUTPUT_TOKENS = 32


def _cpu_times(pid: int) -> tuple[float, float]:
    """``(user, system)`` CPU seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    return sum(_cpu_times(pid))


def process_syscalls(pid: int) -> tuple[int, int]:
    """``(writes, reads)``: system calls so far (``/proc/<pid>/io``; (0, 0) where unreadable)."""
    try:
        fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    except OSError:
        return 0, 0
    return int(fields["syscw"]), int(fields["syscr"])


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _percentile(values: list[float], q: float) -> float | None:
    return None if not values else round(float(np.percentile(np.asarray(values), q)), 3)


class _LoadGenerator:
    def __init__(self, bus: JetStreamBus, instance_ids: list[str]) -> None:
        self.bus = bus
        self.subjects = bus.config.subjects
        self.codec = Codec(producer="bench-load")
        self.instance_ids = instance_ids
        self.sampling = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)
        self.prompt = tuple(range(1, PROMPT_TOKENS + 1))

    async def one(self, request_id: str, index: int, bypass: bool, out: dict[str, list[float]]) -> None:
        started = time.perf_counter()
        try:
            if bypass:
                instance_id: str | None = self.instance_ids[index % len(self.instance_ids)]
            else:
                reply = await self.bus.request(
                    self.subjects.rpc_dispatch,
                    self.codec.encode(
                        DispatchRequest(request_id=request_id, num_prompt_tokens=PROMPT_TOKENS),
                        time=time.time(),
                    ),
                    timeout=2.0,
                    headers={SENT_HEADER: repr(time.time())},
                )
                body = self.codec.decode(reply.data).body
                instance_id = body.instance_id if isinstance(body, DispatchReply) else None
                out["scheduler"].append((time.perf_counter() - started) * 1e3)
            if instance_id is None:
                out["errors"].append(1.0)
                return
            generate = GenerateRequest(
                request_id=request_id, token_ids=self.prompt, sampling=self.sampling, stream=False
            )
            reply = await self.bus.request(
                self.subjects.rpc_agent(instance_id, "generate"),
                self.codec.encode(generate, time=time.time()),
                timeout=2.0,
            )
            accepted = self.codec.decode(reply.data).body
            if isinstance(accepted, GenerateReply) and accepted.accepted:
                out["dispatch"].append((time.perf_counter() - started) * 1e3)
            else:
                out["errors"].append(1.0)
        except BusError:
            out["errors"].append(1.0)

    async def phase(self, name: str, rate: float, duration: float, bypass: bool) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"dispatch": [], "scheduler": [], "errors": []}
        tasks = []
        start = time.perf_counter()
        count = int(rate * duration)
        for index in range(count):
            delay = start + index / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.one(f"{name}-{index}", index, bypass, out)))
        await asyncio.gather(*tasks)
        return out


async def _joined_ids(bus: JetStreamBus) -> list[str]:
    codec = Codec()
    ids: list[str] = []
    if await bus.last_seq(bus.config.subjects.events_stream) == 0:
        return ids
    async with bus.replay(bus.config.subjects.events_stream) as feed:
        async for message in feed:
            envelope = codec.decode_or_none(message.data)
            if envelope is not None and isinstance(envelope.body, InstanceJoined):
                ids.append(envelope.body.instance_id)
    return sorted(set(ids))


async def run_cluster_bench(
    url: str,
    *,
    rates: tuple[float, ...],
    duration: float,
    instances: int,
    processes: int,
    workdir: Path,
    baseline: bool = True,
    nats_pid: int | None = None,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    subjects = Subjects(prefix)
    cli = [sys.executable, "-c", "from frontend.cli import main; main()"]
    stats_files: list[Path] = []

    def start_scheduler() -> subprocess.Popen[bytes]:
        """A fresh ``shoal scheduler`` (it recovers from the log), its decision times in its own file."""
        stats_files.append(workdir / f"scheduler-stats-{len(stats_files)}.json")
        return subprocess.Popen(
            [*cli, "scheduler", "--nats", url, "--prefix", prefix, "--log-level", "WARNING",
             "--stats-file", str(stats_files[-1])]
        )

    scheduler = start_scheduler()
    ids = [f"sim-{k:03d}" for k in range(instances)]
    groups = [ids[k::processes] for k in range(processes)]
    agent_procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agents.bench_fleet",
                "--nats",
                url,
                "--prefix",
                prefix,
                "--ids",
                ",".join(group),
                "--lag-out",
                str(workdir / f"lags-{k}.json"),
            ]
        )
        for k, group in enumerate(groups)
    ]
    rows: list[dict[str, Any]] = []
    windows: list[tuple[str, float, float]] = []
    rounds = [(f"rate{int(r)}", r, False) for r in rates]
    if baseline:
        rounds.append((f"nosched{int(max(rates))}", max(rates), True))
    phases = [(repeat, *phase) for repeat in range(repeats) for phase in rounds]
    progress = BenchProgress("cluster", len(phases) + 1)
    try:
        async with JetStreamBus(BusConfig(url=url, subjects=subjects, name="bench-cluster")) as bus:
            progress.phase(f"starting the scheduler and {instances} sim instances in {processes} processes")
            deadline = time.monotonic() + 120
            while len(await _joined_ids(bus)) < instances:
                if time.monotonic() > deadline:
                    raise RuntimeError("agents did not all join within 120 s")
                await asyncio.sleep(0.5)
            generator = _LoadGenerator(bus, ids)
            await generator.phase("warmup", 20.0, 2.0, False)
            for repeat, name, rate, bypass in phases:
                without = ", scheduler stopped (round-robin placement)" if bypass else ""
                progress.phase(f"round {repeat + 1}/{repeats}: {rate:g} req/s for {duration:g} s{without}")
                if bypass and scheduler.poll() is None:
                    scheduler.send_signal(signal.SIGTERM)
                    scheduler.wait(30)
                elif not bypass and scheduler.poll() is not None:  # after a phase without it: a new one
                    scheduler = start_scheduler()
                    await _wait_dispatching(bus, generator)
                times0 = _cpu_times(scheduler.pid) if scheduler.poll() is None else (0.0, 0.0)
                cpu0 = sum(times0)
                own0 = _own_cpu_seconds()
                io0 = process_syscalls(scheduler.pid) if scheduler.poll() is None else (0, 0)
                nats0 = process_cpu_seconds(nats_pid) if nats_pid else 0.0
                ev0 = await bus.last_seq(subjects.events_stream)
                ld0 = await bus.last_seq(subjects.loads_stream)
                began = time.time()
                wall0 = time.perf_counter()
                # request ids unique per round: an agent answers a known id as a duplicate, without work
                out = await generator.phase(f"{name}-r{repeat}", rate, duration, bypass)
                wall = time.perf_counter() - wall0
                ended = time.time()
                times1 = _cpu_times(scheduler.pid) if scheduler.poll() is None else times0
                sched_cpu = sum(times1) - cpu0
                own_cpu = _own_cpu_seconds() - own0
                io1 = process_syscalls(scheduler.pid) if scheduler.poll() is None else io0
                nats_cpu = process_cpu_seconds(nats_pid) - nats0 if nats_pid else None
                cpu = sched_cpu / wall
                num_requests = int(rate * duration)
                ev = (await bus.last_seq(subjects.events_stream) - ev0) / wall
                ld = (await bus.last_seq(subjects.loads_stream) - ld0) / wall
                windows.append((name, began, ended))
                rows.append(
                    {
                        "rate": rate,
                        "phase": name,
                        "repeat": repeat,
                        "scheduler": not bypass,
                        "duration_s": round(wall, 2),
                        "requests": int(rate * duration),
                        "errors": len(out["errors"]),
                        "dispatch_p50_ms": _percentile(out["dispatch"], 50),
                        "dispatch_p99_ms": _percentile(out["dispatch"], 99),
                        "scheduler_rpc_p50_ms": _percentile(out["scheduler"], 50),
                        "scheduler_rpc_p99_ms": _percentile(out["scheduler"], 99),
                        "scheduler_cpu": round(cpu, 3),
                        "scheduler_cpu_ms_per_request": round(sched_cpu * 1e3 / num_requests, 4),
                        "generator_cpu_ms_per_request": round(own_cpu * 1e3 / num_requests, 4),
                        "scheduler_system_share": round((times1[1] - times0[1]) / sched_cpu, 3)
                        if sched_cpu > 0
                        else None,
                        "scheduler_writes_per_request": round((io1[0] - io0[0]) / num_requests, 3),
                        "scheduler_reads_per_request": round((io1[1] - io0[1]) / num_requests, 3),
                        "nats_cpu_ms_per_request": None
                        if nats_cpu is None
                        else round(nats_cpu * 1e3 / num_requests, 4),
                        "append_eps": round(ev + ld, 1),
                        "events_eps": round(ev, 1),
                        "loads_eps": round(ld, 1),
                        "streaming": "off: one message per finished request",
                        "event_loop": event_loop.loop_name(),
                        "load_average": list(os.getloadavg()),  # 1, 5, 15 min, at the end of the phase
                    }
                )
                await asyncio.sleep(1.0)
    finally:
        if scheduler.poll() is None:
            scheduler.send_signal(signal.SIGTERM)
        for proc in agent_procs:
            proc.send_signal(signal.SIGTERM)
        for proc in [scheduler, *agent_procs]:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    lags: list[tuple[float, float]] = []
    for k in range(processes):
        path = workdir / f"lags-{k}.json"
        if path.exists():
            for samples in json.loads(path.read_text()).values():
                lags.extend((t, lag) for t, lag in samples)
    decisions = [
        entry
        for path in stats_files
        if path.exists()
        for entry in json.loads(path.read_text())["decision_times"]
    ]
    for row, (_, began, ended) in zip(rows, windows, strict=True):
        inside = [ms for t, ms, _ in decisions if began <= t <= ended]
        inbound = [ms for t, _, ms in decisions if began <= t <= ended and ms >= 0]
        row["scheduler_decision_p50_ms"] = _percentile(inside, 50)
        row["scheduler_decision_p99_ms"] = _percentile(inside, 99)
        row["scheduler_inbound_p50_ms"] = _percentile(inbound, 50)
        row["scheduler_inbound_p99_ms"] = _percentile(inbound, 99)
        window = [lag * 1e3 for t, lag in lags if began <= t <= ended]
        row["agent_step_lag_p99_ms"] = _percentile(window, 99)
        row["agent_step_lag_p50_ms"] = _percentile(window, 50)
    return rows if repeats == 1 else rows + median_rows(rows)


def median_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per phase, the median over its repeats of every numeric figure (``"repeat": "median"``)."""
    medians = []
    for phase in dict.fromkeys(row["phase"] for row in rows):
        runs = [row for row in rows if row["phase"] == phase]
        median: dict[str, Any] = {**runs[0], "repeat": "median", "repeats": len(runs)}
        for key, value in runs[0].items():
            values = [row[key] for row in runs]
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if key != "repeat" and numeric and None not in values:
                median[key] = round(float(np.median(values)), 4)
        medians.append(median)
    return medians


async def _wait_dispatching(bus: JetStreamBus, generator: _LoadGenerator, timeout: float = 120.0) -> None:
    """Until a restarted scheduler places requests again (it replays the log first), then a warm-up."""
    codec = Codec(producer="bench-load")
    deadline = time.monotonic() + timeout
    while True:
        try:
            reply = await bus.request(
                bus.config.subjects.rpc_dispatch,
                codec.encode(DispatchRequest(request_id=f"probe-{uuid.uuid4().hex[:8]}", num_prompt_tokens=1),
                             time=time.time()),
                timeout=1.0,
            )
            body = codec.decode(reply.data).body
            if isinstance(body, DispatchReply) and body.instance_id is not None:
                break
        except BusError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the restarted scheduler placed nothing within {timeout:.0f} s")
        await asyncio.sleep(0.5)
    await generator.phase(f"rewarm-{uuid.uuid4().hex[:8]}", 20.0, 2.0, False)


@click.command("cluster")
@click.option(
    "--rates", default="100,250,500", show_default=True, help="Request rates (req/s), comma-separated."
)
@click.option(
    "--duration",
    type=float,
    default=20.0,
    show_default=True,
    help="Seconds per rate; the full sweep: --duration 60 --repeats 3.",
)
@click.option("--instances", type=int, default=64, show_default=True)
@click.option("--processes", type=int, default=4, show_default=True, help="Agent processes.")
@click.option("--no-baseline", is_flag=True, help="Skip the phase with the scheduler stopped.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Rounds of all phases, in turn (a new scheduler after each phase without one, "
              "recovered from the log); the table shows each phase's medians.")
@nats_option(None, help="Use this NATS server instead of an embedded one.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_cluster(
    rates: str,
    duration: float,
    instances: int,
    processes: int,
    no_baseline: bool,
    repeats: int,
    nats_url: str | None,
    json_path: Path | None,
) -> None:
    """Dispatch latency, scheduler CPU, append rate and agent step lag at 64 sim instances.

    The defaults (20 s per rate, one round) take a few minutes on two cores; the full sweep:
    --duration 60 --repeats 3.
    """
    rate_list = tuple(float(r) for r in rates.split(",") if r)
    with tempfile.TemporaryDirectory() as work:
        kwargs: dict[str, Any] = dict(
            rates=rate_list,
            duration=duration,
            instances=instances,
            processes=processes,
            workdir=Path(work),
            baseline=not no_baseline,
            repeats=repeats,
        )
        if nats_url is None:
            with EmbeddedNats(store_dir=Path(work) / "nats") as server:
                rows = event_loop.run(run_cluster_bench(server.url, nats_pid=server.pid, **kwargs))
        else:
            rows = event_loop.run(run_cluster_bench(nats_url, **kwargs))
    median_note = f", medians of {repeats} rounds" if repeats > 1 else ""
    table = Table(
        title=f"{instances} sim instances, prompt {PROMPT_TOKENS}/output {OUTPUT_TOKENS}, "
        f"no per-token streaming (one message per finished request){median_note}"
    )
    for column in (
        "phase",
        "rate",
        "dispatch p50/p99 ms",
        "sched rpc p50/p99 ms",
        "sched CPU",
        "CPU ms/req sched/gen/nats",
        "appends/s",
        "step lag p99 ms",
        "errors",
    ):
        table.add_column(column)
    for row in rows if repeats == 1 else [row for row in rows if row["repeat"] == "median"]:
        table.add_row(
            row["phase"],
            str(row["rate"]),
            f"{row['dispatch_p50_ms']}/{row['dispatch_p99_ms']}",
            f"{row['scheduler_rpc_p50_ms']}/{row['scheduler_rpc_p99_ms']}",
            f"{row['scheduler_cpu']:.2f}",
            f"{row['scheduler_cpu_ms_per_request']:.3f}/{row['generator_cpu_ms_per_request']:.3f}"
            f"/{row['nats_cpu_ms_per_request']}",
            f"{row['append_eps']:.0f}",
            str(row["agent_step_lag_p99_ms"]),
            str(row["errors"]),
        )
    Console().print(table)
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=2))
