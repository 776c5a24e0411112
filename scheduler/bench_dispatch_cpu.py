"""The scheduler's CPU per dispatch, closed loop: ``python -m scheduler.bench_dispatch_cpu``.

Starts an embedded nats-server and a ``shoal scheduler`` process (from
``--scheduler-cwd``, so two checkouts can be compared with one harness), joins
``--instances`` instances by appending their ``InstanceJoined`` events and a
first load report, then runs ``--requests`` dispatches from ``--concurrency``
workers. Each request is exactly what a ``sim`` agent and a frontend without
lifecycle events make the scheduler read: the dispatch RPC, the agent's
``RequestAdmitted`` on ``ev.req.<id>`` (not with ``--no-admitted``: what a
consumer filter on the events the fold ignores would save), and
``--reports-per-request`` load
reports of the chosen instance (its accepted count one higher). The work per
request is fixed, not the rate, so the scheduler's CPU time per request
(user + system, from ``/proc``) hardly moves with other load on the machine,
unlike latencies and open-loop rates. Also reported: the nats-server's CPU per
request and the scheduler's read/write system calls per request. Prints one
JSON object. Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bus import BusConfig, JetStreamBus, event_loop
from bus.errors import BusError
from bus.server import EmbeddedNats
from scheduler.bench_cluster import process_cpu_seconds as _cpu_seconds
from scheduler.bench_cluster import process_syscalls as _syscalls
from schemas import Codec, Subjects
from schemas.instance import InstanceJoined, KVLayout, ModelIdentity
from schemas.load import LoadReport, PriorityLoad
from schemas.requests import RequestAdmitted
from schemas.rpc import DispatchReply, DispatchRequest

__all__ = ["main", "run"]

PROMPT_TOKENS = 128
NUM_BLOCKS = 851


class _Fleet:
    """The instances' side: joins, load reports and ``RequestAdmitted`` events, appended as agents do."""

    def __init__(self, bus: JetStreamBus, num_instances: int) -> None:
        self.bus = bus
        self.subjects = bus.config.subjects
        self.codec = Codec(producer="bench-dispatch-cpu")
        self.ids = [f"inst-{k:03d}" for k in range(num_instances)]
        self.report_seq = dict.fromkeys(self.ids, 0)
        self.accepted = dict.fromkeys(self.ids, 0)

    async def join(self) -> None:
        layout = KVLayout(num_layers=32, num_kv_heads=32, head_dim=128, block_size=16, dtype="float16")
        for iid in self.ids:
            joined = InstanceJoined(
                instance_id=iid, num_blocks=NUM_BLOCKS, block_size=16, model=ModelIdentity(model_id="m"),
                kv_layout=layout, transport_address=f"tcp://{iid}",
            )
            await self.bus.append(self.subjects.instance(iid), self.codec.encode(joined, time=time.time()))
            await self.report(iid)

    async def report(self, iid: str, *, accepted: int = 0) -> None:
        self.report_seq[iid] += 1
        self.accepted[iid] += accepted
        running = self.accepted[iid] % 24
        report = LoadReport(
            instance_id=iid, seq=self.report_seq[iid], num_total_blocks=NUM_BLOCKS,
            num_free_blocks=NUM_BLOCKS - running * 10, num_reserved_blocks=0,
            running=(PriorityLoad(priority=0, num_running=running, num_blocks=running * 10),),
            head_of_line_demand=0, num_waiting=0, batch_size=running, freeness=0.0, virtual_usage=0.0,
            num_accepted=self.accepted[iid],
        )
        await self.bus.append(self.subjects.load(iid), self.codec.encode(report, time=time.time()))

    async def admitted(self, request_id: str, iid: str) -> None:
        event = RequestAdmitted(request_id=request_id, instance_id=iid, queued_s=0.0)
        await self.bus.append(self.subjects.req(request_id), self.codec.encode(event, time=time.time()))


async def _dispatch(bus: JetStreamBus, codec: Codec, request_id: str) -> str | None:
    request = DispatchRequest(request_id=request_id, num_prompt_tokens=PROMPT_TOKENS)
    reply = await bus.request(
        bus.config.subjects.rpc_dispatch, codec.encode(request, time=time.time()), timeout=10.0
    )
    body = codec.decode(reply.data).body
    return body.instance_id if isinstance(body, DispatchReply) else None


async def _workload(
    bus: JetStreamBus, fleet: _Fleet, name: str, count: int, concurrency: int, reports: int, admitted: bool
) -> int:
    codec = Codec(producer="bench-dispatch-cpu")
    failed = 0
    next_index = 0

    async def worker() -> None:
        nonlocal failed, next_index
        while next_index < count:
            request_id = f"{name}-{next_index}"
            next_index += 1
            iid = await _dispatch(bus, codec, request_id)
            if iid is None:
                failed += 1
                continue
            if admitted:
                await fleet.admitted(request_id, iid)
            for k in range(reports):
                await fleet.report(iid, accepted=1 if k == 0 else 0)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return failed


async def run(
    url: str,
    *,
    nats_pid: int,
    requests: int,
    concurrency: int,
    instances: int,
    reports: int,
    scheduler_cwd: Path,
    admitted: bool = True,
    settle_s: float = 1.0,
    profile: Path | None = None,
) -> dict[str, Any]:
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    start = "from frontend.cli import main; main()"
    if profile is not None:  # deterministic profile of the whole scheduler run (slows it down)
        start = f"import cProfile; from frontend.cli import main; cProfile.run('main()', {str(profile)!r})"
    scheduler = subprocess.Popen(
        [
            sys.executable, "-c", start, "scheduler",
            "--nats", url, "--prefix", prefix, "--log-level", "WARNING", "--failure-timeout", "3600",
        ],
        cwd=scheduler_cwd,
    )
    try:
        async with JetStreamBus(BusConfig(url=url, subjects=Subjects(prefix), name="bench-dispatch")) as bus:
            fleet = _Fleet(bus, instances)
            await fleet.join()
            codec = Codec(producer="bench-dispatch-cpu")
            deadline = time.monotonic() + 60
            while True:  # until the scheduler is active and sees the instances
                try:
                    if await _dispatch(bus, codec, f"probe-{uuid.uuid4().hex[:6]}") is not None:
                        break
                except BusError:  # not serving yet
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the scheduler did not start dispatching within 60 s")
                await asyncio.sleep(0.2)
            await _workload(bus, fleet, "warmup", max(200, requests // 10), concurrency, reports, admitted)
            await asyncio.sleep(settle_s)
            cpu0, nats0, io0 = _cpu_seconds(scheduler.pid), _cpu_seconds(nats_pid), _syscalls(scheduler.pid)
            wall0 = time.perf_counter()
            failed = await _workload(bus, fleet, "run", requests, concurrency, reports, admitted)
            wall = time.perf_counter() - wall0
            await asyncio.sleep(settle_s)  # what was sent is read before the CPU is read
            cpu = _cpu_seconds(scheduler.pid) - cpu0
            nats = _cpu_seconds(nats_pid) - nats0
            io1 = _syscalls(scheduler.pid)
    finally:
        scheduler.send_signal(signal.SIGTERM)
        try:
            scheduler.wait(30)
        except subprocess.TimeoutExpired:
            scheduler.kill()
    return {
        "scheduler_cwd": str(scheduler_cwd),
        "requests": requests,
        "failed": failed,
        "concurrency": concurrency,
        "instances": instances,
        "reports_per_request": reports,
        "admitted_events": admitted,
        "wall_s": round(wall, 2),
        "requests_per_s": round(requests / wall, 1),
        "scheduler_cpu_ms_per_request": round(cpu * 1e3 / requests, 4),
        "nats_cpu_ms_per_request": round(nats * 1e3 / requests, 4),
        "scheduler_writes_per_request": round((io1[0] - io0[0]) / requests, 3),
        "scheduler_reads_per_request": round((io1[1] - io0[1]) / requests, 3),
        "settle_s": settle_s,
        "load_average": list(os.getloadavg()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--reports-per-request", type=int, default=1)
    parser.add_argument("--scheduler-cwd", type=Path, default=Path.cwd(),
                        help="Run the scheduler from this checkout (default: the current directory).")
    parser.add_argument("--no-admitted", action="store_true",
                        help="Append no RequestAdmitted per request: what the scheduler would save if it "
                        "were not delivered the events its fold ignores.")
    parser.add_argument("--profile", type=Path, default=None,
                        help="Run the scheduler under cProfile and write its stats here.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work, EmbeddedNats(store_dir=Path(work) / "nats") as server:
        assert server.pid is not None
        result = event_loop.run(
            run(
                server.url, nats_pid=server.pid, requests=args.requests, concurrency=args.concurrency,
                instances=args.instances, reports=args.reports_per_request, admitted=not args.no_admitted,
                scheduler_cwd=args.scheduler_cwd.resolve(),
                profile=None if args.profile is None else args.profile.resolve(),
            )
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
