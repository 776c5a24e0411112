"""The scheduler's CPU per dispatch: the dispatch policies alone (``shoal bench dispatch``,
``python -m scheduler.bench_dispatch_cpu --policies``), or the whole scheduler in a closed loop
(``python -m scheduler.bench_dispatch_cpu``).

**The policies alone** (:func:`measure_policies`): for 16, 256 and 1,000 instances it builds a
populated prefix index (64 system prompts of 128 blocks, each instance caching 8 of them, the first
on every instance; each instance's own 500 blocks), instance views of random load, and a stream of
requests whose 160-block chains are one system prompt and 32 blocks of their own. Each dispatch looks
the chain up in the index (the 32 instances holding most, as the scheduler keeps them), asks the
policy (one dispatcher kept across decisions, as the scheduler keeps it) and applies the decision to
the chosen view; between two dispatches one view takes a new report, as the live scheduler folds
one between decisions: every other time the last dispatch's instance (its report reflects the
dispatch), else a random one. CPU microseconds per dispatch (``time.process_time``), lookup
included (the median of five runs of a fifth of the dispatches each), per policy and instance
count, and the 1,000-instance figure over the 16-instance one. The live scheduler adds building
the views (one per instance) and the event; not measured here.

**The whole scheduler**: starts an embedded nats-server and a ``shoal scheduler`` process (from
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
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import click

from bus import BusConfig, JetStreamBus, event_loop
from bus.errors import BusError
from bus.server import EmbeddedNats
from scheduler.bench_cluster import process_cpu_seconds as _cpu_seconds
from scheduler.bench_cluster import process_syscalls as _syscalls
from scheduler.config import DISPATCH_MENU, DispatchPolicy, PolicyConfig
from scheduler.policy import InstanceLoad, PendingRequest, make_dispatcher
from scheduler.prefix_index import PREFIX_HITS_KEPT, PrefixIndex
from schemas import Codec, Subjects
from schemas.instance import InstanceJoined, KVLayout, ModelIdentity
from schemas.kv_events import KVCacheEvents
from schemas.load import LoadReport, PriorityLoad
from schemas.requests import RequestAdmitted
from schemas.rpc import DispatchReply, DispatchRequest

__all__ = ["bench_dispatch", "main", "measure_policies", "run"]

PROMPT_TOKENS = 128
NUM_BLOCKS = 851


#: The pure-policy benchmark's cluster sizes and request shape.
POLICY_INSTANCES = (16, 256, 1000)
SYSTEM_PROMPTS, SYSTEM_BLOCKS, OWN_BLOCKS, PROMPTS_PER_INSTANCE, INSTANCE_BLOCKS = 64, 128, 32, 8, 500
BLOCK_SIZE = 16


def _random_view(rng: random.Random, instance_id: str, report_seq: int) -> InstanceLoad:
    """A busy instance's view: running requests, sometimes a queue, a prefill in flight or a dispatch
    pending."""
    running = rng.randint(1, 24)
    waiting = rng.choice((0, 0, 0, rng.randint(1, 4)))
    demand = waiting * rng.randint(20, 200)
    pending = rng.choice((0, 0, 1))
    return InstanceLoad(
        instance_id=instance_id,
        num_total_blocks=8192,
        block_size=BLOCK_SIZE,
        reported=True,
        running=(PriorityLoad(priority=0, num_running=running, num_blocks=running * rng.randint(40, 300)),),
        num_waiting=waiting,
        waiting_demand=demand,
        head_of_line_demand=demand // max(waiting, 1),
        waiting_uncached_blocks=demand // rng.randint(1, 8),
        prefill_blocks=rng.choice((0, rng.randint(1, 160))),
        num_pending=pending,
        pending_blocks=pending * 160,
        report_seq=report_seq,
        stream_seq=report_seq,
    )


def _populated_index(rng: random.Random, ids: list[str]) -> tuple[PrefixIndex, list[list[int]]]:
    """An index where every instance caches 8 of the 64 system prompts (the first on every one) and
    500 blocks of its own."""
    prompts = [[rng.getrandbits(63) for _ in range(SYSTEM_BLOCKS)] for _ in range(SYSTEM_PROMPTS)]
    index = PrefixIndex()
    for n, instance_id in enumerate(ids):
        held = [0, *rng.sample(range(1, SYSTEM_PROMPTS), PROMPTS_PER_INSTANCE - 1)]
        stored = [h for k in held for h in prompts[k]] + [rng.getrandbits(63) for _ in range(INSTANCE_BLOCKS)]
        index.apply(
            KVCacheEvents(
                instance_id=instance_id,
                incarnation=f"{n:012x}",
                seq=1,
                block_size=BLOCK_SIZE,
                full=True,
                stored=tuple(stored),
            )
        )
    return index, prompts


def measure_policies(
    policies: tuple[DispatchPolicy, ...] = DISPATCH_MENU,
    instance_counts: tuple[int, ...] = POLICY_INSTANCES,
    *,
    dispatches: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """CPU microseconds per dispatch of each policy at each instance count (see the module docstring):
    the median over the five fifths of the ``dispatches``."""
    rows: dict[str, dict[str, float]] = {policy.value: {} for policy in policies}
    choose_rows: dict[str, dict[str, float]] = {policy.value: {} for policy in policies}
    lookups: dict[str, float] = {}
    for num_instances in instance_counts:
        rng = random.Random(seed)
        ids = [f"inst-{k:04d}" for k in range(num_instances)]
        index, prompts = _populated_index(rng, ids)
        chains = [
            (
                *prompts[rng.choice((0, rng.randrange(SYSTEM_PROMPTS)))],
                *(rng.getrandbits(63) for _ in range(OWN_BLOCKS)),
            )
            for _ in range(256)
        ]
        started = time.process_time()
        for chain in chains * 4:
            index.overlap(chain, block_size=BLOCK_SIZE, limit=PREFIX_HITS_KEPT)
        lookups[str(num_instances)] = round((time.process_time() - started) / (4 * len(chains)) * 1e6, 2)
        for policy in policies:
            config = PolicyConfig(dispatch_policy=policy)
            dispatcher = make_dispatcher(policy, config)
            draw = random.Random(seed + 1)
            views = [_random_view(draw, instance_id, 1) for instance_id in ids]
            position = {instance_id: k for k, instance_id in enumerate(ids)}
            elapsed = choosing = 0.0
            chunks: list[tuple[float, float]] = []  # CPU seconds of each fifth: whole, the policy's part
            reflect: int | None = None  # the instance of the last dispatch: its next report reflects it
            for n in range(dispatches):
                # one new report between two dispatches: that of the last dispatch's instance, or another's
                k = draw.randrange(num_instances) if reflect is None or n % 2 else reflect
                views[k] = _random_view(draw, ids[k], views[k].report_seq + 1)
                chain = chains[n % len(chains)]
                started = time.process_time()
                found = index.overlap(chain, block_size=BLOCK_SIZE, limit=PREFIX_HITS_KEPT)
                request = PendingRequest(
                    request_id=f"r{n}",
                    num_prompt_tokens=len(chain) * BLOCK_SIZE,
                    cached_tokens=tuple(sorted((i, blocks * BLOCK_SIZE) for i, blocks in found.items())),
                )
                asked = time.process_time()
                decision = dispatcher.choose(request, views, num_dispatched=n)
                done = time.process_time()
                elapsed += done - started
                choosing += done - asked
                if decision is not None:
                    reflect = chosen = position[decision.instance_id]
                    views[chosen] = views[chosen].with_dispatch(decision.demand_blocks)
                if (n + 1) % (dispatches // 5) == 0:
                    chunks.append((elapsed, choosing))
                    elapsed = choosing = 0.0
            per_chunk = dispatches // 5
            whole = statistics.median(part[0] for part in chunks)
            rows[policy.value][str(num_instances)] = round(whole / per_chunk * 1e6, 2)
            alone = statistics.median(part[1] for part in chunks)
            choose_rows[policy.value][str(num_instances)] = round(alone / per_chunk * 1e6, 2)
    first, last = str(instance_counts[0]), str(instance_counts[-1])
    return {
        "us_per_dispatch": rows,
        "ratio_last_to_first": {name: round(row[last] / row[first], 2) for name, row in rows.items()},
        "choose_us": choose_rows,
        "lookup_us": lookups,
        "instances": list(instance_counts),
        "dispatches": dispatches,
        "chain_blocks": SYSTEM_BLOCKS + OWN_BLOCKS,
        "index": {
            "system_prompts": SYSTEM_PROMPTS,
            "system_prompt_blocks": SYSTEM_BLOCKS,
            "prompts_per_instance": PROMPTS_PER_INSTANCE,
            "own_blocks_per_instance": INSTANCE_BLOCKS,
            "hits_kept": PREFIX_HITS_KEPT,
        },
        "seed": seed,
        "load_average": list(os.getloadavg()),
    }


@click.command("dispatch")
@click.option(
    "--dispatches", type=int, default=2000, show_default=True, help="Dispatches per policy and size."
)
@click.option(
    "--instances",
    default=",".join(map(str, POLICY_INSTANCES)),
    show_default=True,
    help="Instance counts, comma-separated.",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the result here.",
)
def bench_dispatch(dispatches: int, instances: str, json_path: Path | None) -> None:
    """CPU per dispatch of each dispatch policy at 16, 256 and 1,000 instances, prefix index populated."""
    counts = tuple(int(part) for part in instances.split(","))
    result = measure_policies(instance_counts=counts, dispatches=dispatches)
    header = "policy".ljust(16) + "".join(f"{n:>16,}" for n in counts) + "   last/first"
    click.echo(f"CPU us per dispatch, the prefix lookup of a {result['chain_blocks']}-block chain included")
    click.echo("(in brackets: the policy's choice alone)")
    click.echo(header)
    for name, row in result["us_per_dispatch"].items():
        alone = result["choose_us"][name]
        cells = "".join(f"{row[str(n)]:>9.1f} ({alone[str(n)]:>4.0f})" for n in counts)
        click.echo(f"{name:<16}{cells}   {result['ratio_last_to_first'][name]:>6.2f}x")
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1) + "\n")


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
                instance_id=iid,
                num_blocks=NUM_BLOCKS,
                block_size=16,
                model=ModelIdentity(model_id="m"),
                kv_layout=layout,
                transport_address=f"tcp://{iid}",
            )
            await self.bus.append(self.subjects.instance(iid), self.codec.encode(joined, time=time.time()))
            await self.report(iid)

    async def report(self, iid: str, *, accepted: int = 0) -> None:
        self.report_seq[iid] += 1
        self.accepted[iid] += accepted
        running = self.accepted[iid] % 24
        report = LoadReport(
            instance_id=iid,
            seq=self.report_seq[iid],
            num_total_blocks=NUM_BLOCKS,
            num_free_blocks=NUM_BLOCKS - running * 10,
            num_reserved_blocks=0,
            running=(PriorityLoad(priority=0, num_running=running, num_blocks=running * 10),),
            head_of_line_demand=0,
            num_waiting=0,
            batch_size=running,
            freeness=0.0,
            virtual_usage=0.0,
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
            sys.executable,
            "-c",
            start,
            "scheduler",
            "--nats",
            url,
            "--prefix",
            prefix,
            "--log-level",
            "WARNING",
            "--failure-timeout",
            "3600",
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
    if "--policies" in sys.argv[1:]:  # the policies alone: shoal bench dispatch
        sys.argv.remove("--policies")
        bench_dispatch()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--reports-per-request", type=int, default=1)
    parser.add_argument(
        "--scheduler-cwd",
        type=Path,
        default=Path.cwd(),
        help="Run the scheduler from this checkout (default: the current directory).",
    )
    parser.add_argument(
        "--no-admitted",
        action="store_true",
        help="Append no RequestAdmitted per request: what the scheduler would save if it "
        "were not delivered the events its fold ignores.",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="Run the scheduler under cProfile and write its stats here.",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work, EmbeddedNats(store_dir=Path(work) / "nats") as server:
        assert server.pid is not None
        result = event_loop.run(
            run(
                server.url,
                nats_pid=server.pid,
                requests=args.requests,
                concurrency=args.concurrency,
                instances=args.instances,
                reports=args.reports_per_request,
                admitted=not args.no_admitted,
                scheduler_cwd=args.scheduler_cwd.resolve(),
                profile=None if args.profile is None else args.profile.resolve(),
            )
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
