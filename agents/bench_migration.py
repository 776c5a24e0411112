"""``shoal bench migration``: downtime of live migration vs blocking copy vs recompute, by sequence length.

Setup (stated in the output): two agents driving the torch engine (``kv-heavy``
preset by default, float32 on CPU) or, with ``--engine vllm --model DIR``, the
vllm engine (float32 on CPU; vLLM runs one engine's forward pass at a time per
process, see :mod:`agents.engines.vllm_engine.engine`) in one process, each on its own thread and
event loop with its own NATS connection (an embedded nats-server unless
``--nats``) and its own KV transport (TCP on loopback by default); one torch
intra-op thread per agent. Each run puts ``--background`` other requests
decoding on both instances, and the request to move — ``seq_len`` tokens of KV
filled without prefill (:func:`agents.bench_harness.admit_filled`) — on the
source. A client subscribed to its token subject records arrival times.

* **live**: the agent's multi-stage live migration, its copies unpaced (``copy_step_share`` 0);
* **paced**: the same with the copies paced to ``--copy-share`` of the source's steps, on both
  sides (agents: ``--migration-copy-share``, off by default);
* **blocking**: the same machinery with ``max_stages=1``: suspend, copy everything, resume there;
* **recompute**: drop it on the source, send prompt + generated tokens to the destination,
  which prefills them again (the rescue path).

Downtime, client-side: the gap between the last token before the move and the
first after it, minus the request's median inter-token gap before the move.
Agent-side: ``Commit.suspended_at`` to ``CommitAck.resumed_at`` read back from
the migration's events (live, blocking); for recompute, the drop to the first
token the destination published (its delta's envelope time). Also: the number
of stages, the transport bandwidth of the stage copies, and the source's decode
step time for its co-located requests before and during a live migration, and the KV
bytes a migration did not copy because the destination's prefix cache held them. Every
run moves the same tokens, so the engines' prefix caches are emptied after each run: no
run finds an earlier one's blocks (a migration would copy none of them, a recompute
prefill none), and every method moves KV the destination lacks.
Every figure is a median over ``--repeats`` runs; recompute at lengths of
``--long-from`` tokens and more runs ``--recompute-long-repeats`` times (an 8k
prefill takes tens of seconds on a CPU), which the output says. The defaults
move requests of 256 and 1024 tokens twice each by every method; the full
sweep (``--seq-lens 256,1024,2048,4096,8192 --repeats 5``) is an option. A
paced copy stretches with the machine's load: it yields to the source's steps.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import platform
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import click

from bus import event_loop
from bus.bench_progress import BenchProgress
from bus.options import nats_option
from schemas import TokenDelta

__all__ = ["METHODS", "bench_migration", "run_benchmark"]

#: live: unpaced multi-stage; paced: the same with MigrationConfig.copy_step_share (both sides).
METHODS = ("live", "paced", "blocking", "recompute")

_PATH = click.Path(dir_okay=False, path_type=Path)


class MigrationFailed(RuntimeError):
    """A measured migration did not complete (counted in the row's ``failures``)."""


@dataclass
class Sample:
    client_ms: float
    agent_ms: float | None
    stages: int = 0
    stage_bytes: int = 0
    stage_seconds: float = 0.0
    step_ms_idle: float | None = None
    step_ms_migrating: float | None = None
    gap_ms_idle: float | None = None
    gap_ms_migrating: float | None = None
    copy_s: float | None = None
    chunks: int = 0
    #: blocks copied while the request was suspended (the last stage): what the downtime carries
    last_stage_blocks: int | None = None
    #: KV bytes not copied: blocks the destination's prefix cache already held
    bytes_saved: int = 0


@dataclass
class Row:
    seq_len: int
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def median(self, method: str, attribute: str) -> float | None:
        values = [getattr(s, attribute) for s in self.samples.get(method, [])]
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def as_json(self) -> dict[str, Any]:
        live = self.samples.get("live", [])
        blocking = self.samples.get("blocking", [])
        copies = [s for s in live + blocking if s.stage_seconds > 0]
        paced = self.samples.get("paced", [])
        bandwidth = (
            statistics.median(s.stage_bytes / s.stage_seconds / 1e9 for s in copies) if copies else None
        )
        return {
            "seq_len": self.seq_len,
            "live_ms": self.median("live", "client_ms"),
            "blocking_ms": self.median("blocking", "client_ms"),
            "recompute_ms": self.median("recompute", "client_ms"),
            "live_agent_ms": self.median("live", "agent_ms"),
            "blocking_agent_ms": self.median("blocking", "agent_ms"),
            "recompute_agent_ms": self.median("recompute", "agent_ms"),
            "stages": self.median("live", "stages"),
            "live_stage_bytes": self.median("live", "stage_bytes"),
            "live_bytes_saved": self.median("live", "bytes_saved"),
            "transport_gb_per_s": bandwidth,
            "colocated_step_ms_idle": self.median("live", "step_ms_idle"),
            "colocated_step_ms_migrating": self.median("live", "step_ms_migrating"),
            "colocated_gap_ms_idle": self.median("live", "gap_ms_idle"),
            "colocated_gap_ms_migrating": self.median("live", "gap_ms_migrating"),
            "live_copy_s": self.median("live", "copy_s"),
            "paced_ms": self.median("paced", "client_ms"),
            "paced_agent_ms": self.median("paced", "agent_ms"),
            "paced_stages": self.median("paced", "stages"),
            "live_last_stage_blocks": self.median("live", "last_stage_blocks"),
            "paced_last_stage_blocks": self.median("paced", "last_stage_blocks"),
            "paced_chunks": self.median("paced", "chunks"),
            "paced_copy_s": self.median("paced", "copy_s"),
            "paced_step_ms_idle": self.median("paced", "step_ms_idle"),
            "paced_step_ms_migrating": self.median("paced", "step_ms_migrating"),
            "paced_gap_ms_idle": self.median("paced", "gap_ms_idle"),
            "paced_gap_ms_migrating": self.median("paced", "gap_ms_migrating"),
            "step_ratio_live": _ratio(live, "step_ms_migrating", "step_ms_idle"),
            "step_ratio_paced": _ratio(paced, "step_ms_migrating", "step_ms_idle"),
            "gap_ratio_live": _ratio(live, "gap_ms_migrating", "gap_ms_idle"),
            "gap_ratio_paced": _ratio(paced, "gap_ms_migrating", "gap_ms_idle"),
            "repeats": {method: len(samples) for method, samples in sorted(self.samples.items())},
            "failures": self.failures,
        }


def _ratio(samples: list[Sample], during: str, idle: str) -> float | None:
    """The median over runs of one run's ``during / idle`` (each run's own baseline)."""
    ratios = [
        getattr(s, during) / getattr(s, idle)
        for s in samples
        if getattr(s, during) is not None and getattr(s, idle)
    ]
    return statistics.median(ratios) if ratios else None


class Client:
    """Subscribes to a request's tokens and records arrivals (its own loop, in the benchmark thread)."""

    def __init__(self, bus: Any, codec: Any) -> None:
        self.bus = bus
        self.codec = codec
        self.arrivals: list[tuple[float, int, int, float]] = []  # (arrival, first index, epoch, sent at)

    async def watch(self, subject: str) -> Any:
        subscription = await self.bus.subscribe(subject)

        async def collect() -> None:
            async for message in subscription:
                envelope = self.codec.decode_or_none(message.data)
                if envelope is not None and isinstance(envelope.body, TokenDelta):  # not an agent's probe
                    delta = envelope.body
                    self.arrivals.append(
                        (time.perf_counter(), delta.first_index, delta.owner_epoch, envelope.time)
                    )

        return subscription, asyncio.get_running_loop().create_task(collect())

    def count(self, epoch: int) -> int:
        return sum(1 for a in self.arrivals if a[2] == epoch)


async def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


async def _one_run(
    method: str,
    seq_len: int,
    source: Any,
    destination: Any,
    client: Client,
    *,
    background: int,
    gaps: int,
    copy_share: float = 0.1,
) -> Sample:
    from agents.bench_harness import drop_everything, is_empty

    run_id = uuid.uuid4().hex[:8]
    try:
        return await _measure(
            method,
            seq_len,
            source,
            destination,
            client,
            run_id,
            background=background,
            gaps=gaps,
            copy_share=copy_share,
        )
    finally:
        for agent in (source, destination):
            agent.call(drop_everything)
        for agent in (source, destination):
            await _wait(lambda a=agent: a.call(is_empty), 60, "engines to empty")
        for agent in (source, destination):
            agent.call(_forget_cached_prefixes)


def _forget_cached_prefixes(agent: Any) -> None:
    """Empty the prefix cache of an engine on shoal's local scheduler (the next run moves the
    same tokens and must not find this run's blocks)."""
    from agents.engines.local_scheduler import LocalScheduler

    scheduler = getattr(agent.engine, "scheduler", None)
    if isinstance(scheduler, LocalScheduler):
        scheduler.blocks.clear_cache()


async def _measure(
    method: str,
    seq_len: int,
    source: Any,
    destination: Any,
    client: Client,
    run_id: str,
    *,
    background: int,
    gaps: int,
    copy_share: float,
) -> Sample:
    from agents.bench_harness import admit_filled

    request_id = f"m{run_id}"
    for index in range(background):
        source.call(lambda a, i=index: admit_filled(a, f"bgs{run_id}{i}", 256, salt=i))
        destination.call(lambda a, i=index: admit_filled(a, f"bgd{run_id}{i}", 256, salt=i + 50))
    subscription, collector = await client.watch(source.agent.subjects.tok(request_id))
    client.arrivals = []
    try:
        return await _move(
            method, seq_len, source, destination, client, request_id, gaps=gaps, copy_share=copy_share
        )
    finally:
        await subscription.unsubscribe()
        collector.cancel()


async def _move(
    method: str,
    seq_len: int,
    source: Any,
    destination: Any,
    client: Client,
    request_id: str,
    *,
    gaps: int,
    copy_share: float,
) -> Sample:
    from agents.bench_harness import admit_filled, drop_request
    from schemas import GenerateRequest, SamplingParams

    source.call(lambda a: admit_filled(a, request_id, seq_len, salt=seq_len))
    await _wait(lambda: client.count(0) >= gaps + 1, 120, "tokens before the move")
    before = [a[0] for a in client.arrivals if a[2] == 0]
    median_gap = statistics.median(b - a for a, b in itertools.pairwise(before[1:]))
    steps_before = len(source.steps)
    moved_at = time.perf_counter()
    outcome: Any = None
    dropped_at = 0.0
    if method == "recompute":
        dropped_at = time.time()
        dropped = source.call(lambda a: drop_request(a, request_id))
        assert dropped is not None
        tokens, num_prompt = dropped
        request = GenerateRequest(
            request_id=request_id,
            token_ids=tokens,
            num_prompt_tokens=num_prompt,
            first_index=len(tokens) - num_prompt,
            owner_epoch=1,
            sampling=SamplingParams(max_tokens=1_000_000, ignore_eos=True, temperature=0.0),
        )
        reply = destination.call(lambda a: a.generate(request))
        assert reply.accepted, (reply.reason, reply.detail)
    else:
        config = source.agent.config.migration
        if method == "blocking":
            config = replace(config, max_stages=1, copy_step_share=0.0)
        elif method == "live":
            config = replace(config, copy_step_share=0.0)
        else:  # paced, as agents do by default; both sides pace (the destination reads its manager's config)
            config = replace(config, copy_step_share=copy_share)
        unpaced = destination.agent.migration.config
        paced = replace(
            unpaced,
            copy_step_share=config.copy_step_share,
            last_stage_max_blocks=config.last_stage_max_blocks,
        )
        destination.call(lambda a: setattr(a.migration, "config", paced))
        try:
            outcome = await asyncio.to_thread(
                source.call, lambda a: a.migrate(request_id, destination.agent.instance_id, config=config)
            )
        finally:
            destination.call(lambda a: setattr(a.migration, "config", unpaced))
        if not outcome.migrated:
            why = f"{outcome.reason} ({outcome.detail})"
            raise MigrationFailed(f"{method} migration of {seq_len} tokens failed: {why}")
    await _wait(lambda: client.count(1) >= 1, 300, "the first token after the move")
    last_before = max(a[0] for a in client.arrivals if a[2] == 0)
    first_after = min(a for a in client.arrivals if a[2] == 1)
    sample = Sample(client_ms=(first_after[0] - last_before - median_gap) * 1e3, agent_ms=None)
    if method == "recompute":
        sample.agent_ms = (first_after[3] - dropped_at) * 1e3
    else:
        sample.agent_ms = await _logged_downtime_ms(client, source.agent.subjects, outcome.migration_id)
        if sample.agent_ms is None and outcome.downtime_s is not None:  # the log lagged: same two stamps
            sample.agent_ms = outcome.downtime_s * 1e3
        sample.stages = outcome.num_stages
        sample.stage_bytes = sum(s.num_bytes for s in outcome.stages)
        sample.bytes_saved = outcome.bytes_saved
        sample.stage_seconds = sum(s.duration_s for s in outcome.stages)
        sample.chunks = sum(s.num_chunks for s in outcome.stages)
        sample.last_stage_blocks = outcome.stages[-1].num_blocks if outcome.stages else None
        sample.copy_s = (outcome.suspended_at or time.time()) - outcome.started_at
        idle_steps = source.steps[:steps_before][-gaps - 1 :]
        suspended = outcome.suspended_at or time.time()
        window_end = moved_at + (suspended - outcome.started_at)
        during_steps = [s for s in source.steps[steps_before - 1 :] if s.ended_at <= window_end]
        idle = [s.duration_s for s in idle_steps[1:]]
        during = [s.duration_s for s in during_steps[1:]]
        sample.step_ms_idle = statistics.median(idle) * 1e3 if idle else None
        sample.step_ms_migrating = statistics.median(during) * 1e3 if during else None
        sample.gap_ms_idle = _median_gap_ms(idle_steps)
        sample.gap_ms_migrating = _median_gap_ms(during_steps)
    return sample


def _median_gap_ms(steps: Sequence[Any]) -> float | None:
    """The median time from one step's end to the next's: the co-located requests' token period."""
    gaps = [b.ended_at - a.ended_at for a, b in itertools.pairwise(steps)]
    return statistics.median(gaps) * 1e3 if gaps else None


async def _logged_downtime_ms(client: Client, subjects: Any, migration_id: str) -> float | None:
    """Suspend (``Commit.suspended_at``) to resume (``CommitAck.resumed_at``), read back from the events."""
    from schemas import Commit, CommitAck

    suspended = resumed = None
    subject = subjects.mig(migration_id)
    async with client.bus.replay(subjects.events_stream, subjects=[subject, f"{subject}.outcome"]) as feed:
        async for stored in feed:
            envelope = client.codec.decode_or_none(stored.data)
            body = None if envelope is None else envelope.body
            if isinstance(body, Commit):
                suspended = body.suspended_at
            elif isinstance(body, CommitAck):
                resumed = body.resumed_at
    if suspended is None or resumed is None:
        return None
    return (resumed - suspended) * 1e3


def _runs(method: str, seq_len: int, round_index: int, long_from: int, recompute_long_repeats: int) -> bool:
    """Whether round ``round_index`` moves a ``seq_len``-token request by ``method``."""
    return not (method == "recompute" and seq_len >= long_from and round_index >= recompute_long_repeats)


def run_benchmark(
    *,
    seq_lens: Sequence[int],
    repeats: int,
    recompute_long_repeats: int,
    long_from: int,
    preset: str,
    transport: str,
    background: int,
    gaps: int,
    nats_url: str | None,
    engine: str = "torch",
    model: str | None = None,
    max_model_len: int = 2048,
    methods: Sequence[str] = METHODS,
    copy_share: float = 0.1,
    engine_core: str = "thread",
) -> dict[str, Any]:
    """Run every (length, method, repeat) and return the JSON document.

    ``engine="vllm"`` runs the vllm engine on the checkpoint folder ``model``
    (``preset`` is then unused) with ``max_model_len`` tokens of context.
    """
    import torch

    from agents.agent import AgentConfig
    from agents.bench_harness import AgentThread
    from agents.engines.torch_engine import TorchEngine
    from agents.migration.fsm.config import MigrationConfig
    from bus import BusConfig, JetStreamBus
    from bus.server import EmbeddedNats
    from schemas import Codec, Subjects
    from transport import TransportConfig

    if engine == "torch":  # vLLM's CPU worker binds its own OpenMP threads (its attention kernel checks them)
        torch.set_num_threads(1)
    server = None
    if nats_url is None:
        server = EmbeddedNats().start()
        nats_url = server.url
    subjects = Subjects(f"bench{uuid.uuid4().hex[:8]}")
    kv_bytes_per_token = 0
    if engine == "vllm":
        if model is None:
            raise ValueError("the vllm engine needs a checkpoint folder (model)")
        if max(seq_lens) + 600 > max_model_len:
            raise ValueError(f"sequence lengths up to {max(seq_lens)} + 600 decoded exceed {max_model_len}")
        block_size = 32  # vLLM's CPU attention wants multiples of 32
        # vLLM wants room for one request of the full context; the rest as for the torch engine
        num_blocks = max_model_len // block_size + background * 24 + 8
    else:
        block_size = 16
        num_blocks = (max(seq_lens) + 600) // block_size + background * 48 + 8

    def build_engine() -> Any:
        if engine == "vllm":
            from agents.engines.vllm_engine.engine import VllmEngine

            assert model is not None
            return VllmEngine(
                model,
                num_blocks=num_blocks,
                block_size=block_size,
                kv_cache_bytes=512 * 2**20,
                max_model_len=max_model_len,
                max_batch_size=64,
                dtype="float32",
            )
        return TorchEngine(
            preset, num_blocks=num_blocks, block_size=block_size, max_batch_size=64, core=engine_core,
            core_threads=1,
        )

    def make(instance_id: str) -> AgentThread:
        config = AgentConfig(
            instance_id=instance_id,
            # the background requests have no listener on purpose: no abort of "orphans" here
            orphan_check_interval_s=0.0,
            migration=MigrationConfig(
                copy_timeout_s=120.0,
                destination_idle_timeout_s=300.0,
                ack_timeout_s=30.0,
                commit_timeout_s=30.0,
            ),
            transport=TransportConfig(
                kind="ucx" if transport == "ucx" else "tcp",
                ucx_tls="tcp" if transport == "ucx" else "",
                send_timeout_s=120.0,
            ),
        )
        return AgentThread(
            build_engine,
            config,
            nats_url,
            subjects,
        )

    source, destination = make("src"), make("dst")
    rows: list[Row] = []
    started = time.monotonic()
    total = sum(
        _runs(method, seq_len, round_index, long_from, recompute_long_repeats)
        for seq_len in seq_lens
        for round_index in range(repeats)
        for method in methods
    )
    progress = BenchProgress("migration", total + 1)
    try:
        progress.phase(f"starting two {engine} agents ({preset if engine == 'torch' else model})")
        source.start()
        destination.start()
        assert source.agent is not None
        info = source.agent.engine.info
        kv_bytes_per_token = info.bytes_per_block // info.block_size

        async def main() -> None:
            bus = JetStreamBus(BusConfig(url=nats_url, subjects=subjects, name="bench-client"))
            await bus.connect()
            client = Client(bus, Codec(producer="bench"))
            try:
                for seq_len in seq_lens:
                    row = Row(seq_len)
                    rows.append(row)
                    # rounds alternate the methods, so a change in the machine's load hits them alike
                    for round_index in range(repeats):
                        for method in methods:
                            samples = row.samples.setdefault(method, [])
                            if not _runs(method, seq_len, round_index, long_from, recompute_long_repeats):
                                continue
                            run = f"run {round_index + 1}/{repeats}"
                            progress.phase(f"{method} move of {seq_len} tokens, {run}")
                            try:
                                sample = await _one_run(
                                    method,
                                    seq_len,
                                    source,
                                    destination,
                                    client,
                                    background=background,
                                    gaps=gaps,
                                    copy_share=copy_share,
                                )
                            except MigrationFailed as exc:
                                row.failures.append(str(exc))
                                progress.note(f"FAILED: {exc}")
                            else:
                                samples.append(sample)
                    progress.note(f"{seq_len} tokens done")
            finally:
                await bus.close()

        event_loop.run(main())
    finally:
        source.stop()
        destination.stop()
        if server is not None:
            server.cleanup()  # the NATS store it made goes too
    return {
        "benchmark": "migration",
        "setup": {
            "engine": engine,
            **({"model": model, "max_model_len": max_model_len} if engine == "vllm" else {"preset": preset}),
            "kv_bytes_per_token": kv_bytes_per_token,
            "block_size": block_size,
            "transport": transport,
            "torch_threads_per_agent": 1 if engine == "torch" else "vLLM's CPU default",
            "agents": "two agents in one process, each on its own thread, event loop, NATS connection and "
            "transport; KV export/import in worker threads; "
            + (
                "the steps of an agent with a migration in flight in worker threads (other steps inline)"
                if engine_core == "thread"
                else "each engine's model step in a child process of its own (engine core 'process')"
            ),
            **({"engine_core": engine_core} if engine == "torch" else {}),
            "event_loop": event_loop.loop_name(),
            "background_requests_per_instance": background,
            "repeats": repeats,
            "methods": list(methods),
            "paced_copy_step_share": copy_share,
            "load_average": list(__import__("os").getloadavg()),
            "recompute_repeats_from_long": {"from_seq_len": long_from, "repeats": recompute_long_repeats},
            "machine": platform.platform(),
            "cpu_count": __import__("os").cpu_count(),
            "runtime_s": round(time.monotonic() - started, 1),
        },
        "rows": [row.as_json() for row in rows],
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'seq_len':>7} {'live ms':>8} {'live agent':>10} {'stages':>6} {'blocking ms':>11} "
        f"{'recompute ms':>12} {'block/live':>10} {'recomp/live':>11} {'GB/s':>5} "
        f"{'step idle':>9} {'step mig':>8}"
    )
    lines = [header]
    for row in rows:
        live = row["live_ms"] or float("nan")
        lines.append(
            f"{row['seq_len']:>7} {_fmt(row['live_ms']):>8} {_fmt(row['live_agent_ms']):>10} "
            f"{_fmt(row['stages'], 0):>6} {_fmt(row['blocking_ms']):>11} {_fmt(row['recompute_ms']):>12} "
            f"{_fmt((row['blocking_ms'] or 0) / live):>10} {_fmt((row['recompute_ms'] or 0) / live):>11} "
            f"{_fmt(row['transport_gb_per_s'], 2):>5} {_fmt(row['colocated_step_ms_idle']):>9} "
            f"{_fmt(row['colocated_step_ms_migrating']):>8}"
        )
    return "\n".join(lines)


def _pacing_table(rows: list[dict[str, Any]]) -> str:
    """The source's co-located decoding while a live migration copies: unpaced (live) and paced."""
    header = (
        f"{'seq_len':>7} {'method':>6} {'step idle':>9} {'step mig':>8} {'ratio':>5} "
        f"{'gap idle':>8} {'gap mig':>8} {'ratio':>5} {'copy s':>6} {'downtime':>8} {'agent':>6} {'last':>4}"
    )
    lines = [
        "co-located decode steps on the source (ms; ratio = median of each run's mig/idle); downtime at the"
        " client and the agent (ms); last = blocks copied while suspended",
        header,
    ]
    for row in rows:
        for method, prefix in (("live", "colocated_"), ("paced", "paced_")):
            step_idle = row.get(f"{prefix}step_ms_idle")
            if step_idle is None:
                continue
            gap = "colocated_gap" if method == "live" else "paced_gap"
            lines.append(
                f"{row['seq_len']:>7} {method:>6} {_fmt(step_idle):>9} "
                f"{_fmt(row[f'{prefix}step_ms_migrating']):>8} {_fmt(row[f'step_ratio_{method}'], 2):>5} "
                f"{_fmt(row[f'{gap}_ms_idle']):>8} {_fmt(row[f'{gap}_ms_migrating']):>8} "
                f"{_fmt(row[f'gap_ratio_{method}'], 2):>5} {_fmt(row[f'{method}_copy_s'], 2):>6} "
                f"{_fmt(row[f'{method}_ms']):>8} {_fmt(row[f'{method}_agent_ms']):>6} "
                f"{_fmt(row[f'{method}_last_stage_blocks'], 0):>4}"
            )
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    lengths = [row["seq_len"] for row in rows]
    for key, label in (
        ("live_ms", "live (client)"),
        ("live_agent_ms", "live (agent)"),
        ("paced_ms", "paced (client)"),
        ("paced_agent_ms", "paced (agent)"),
        ("blocking_ms", "blocking copy"),
        ("recompute_ms", "recompute"),
    ):
        points = [(n, row[key]) for n, row in zip(lengths, rows, strict=True) if row.get(key) is not None]
        if points:
            axis.plot([p[0] for p in points], [max(p[1], 0.1) for p in points], marker="o", label=label)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("sequence length (tokens)")
    axis.set_ylabel("downtime (ms)")
    axis.set_title("shoal migration downtime")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


@click.command("migration")
@click.option("--json", "json_path", type=_PATH, help="Write the results as JSON here.")
@click.option(
    "--plot",
    "plot_path",
    type=_PATH,
    help="PNG plot path (default: beside --json, or ./bench_migration.png).",
)
@click.option(
    "--seq-lens",
    default="256,1024",
    show_default=True,
    help="Sequence lengths (tokens) of the moved request; the full sweep: 256,1024,2048,4096,8192.",
)
@click.option("--repeats", default=2, show_default=True, help="Runs per point (median); the full sweep: 5.")
@click.option(
    "--recompute-long-repeats", default=2, show_default=True, help="Recompute runs at long lengths."
)
@click.option("--long-from", default=8192, show_default=True, help="Lengths from here count as long.")
@click.option("--preset", default="kv-heavy", show_default=True, help="torch: model preset.")
@click.option("--engine", type=click.Choice(["torch", "vllm"]), default="torch", show_default=True)
@click.option("--model", default=None, help="vllm: a local checkpoint folder.")
@click.option("--max-model-len", default=2048, show_default=True, help="vllm: context length.")
@click.option("--transport", type=click.Choice(["tcp", "ucx"]), default="tcp", show_default=True)
@click.option(
    "--methods",
    default=",".join(METHODS),
    show_default=True,
    help="Comma-separated: live (unpaced), paced (copy_step_share = --copy-share), blocking, recompute.",
)
@click.option(
    "--copy-share",
    default=0.1,
    show_default=True,
    type=click.FloatRange(0.0, 1.0, min_open=True),
    help="paced: the share of an engine step each copy chunk may cost.",
)
@click.option("--engine-core", type=click.Choice(["thread", "process"]), default="thread", show_default=True,
              help="torch: where each agent's model step computes (see shoal agent --engine-core).")
@click.option("--background", default=2, show_default=True, help="Co-located decoding requests per instance.")
@click.option("--gaps", default=6, show_default=True, help="Tokens observed before each move.")
@nats_option(None, help="Use this NATS server instead of an embedded one.")
def bench_migration(
    json_path: Path | None,
    plot_path: Path | None,
    seq_lens: str,
    repeats: int,
    recompute_long_repeats: int,
    long_from: int,
    preset: str,
    transport: str,
    background: int,
    gaps: int,
    nats_url: str | None,
    engine: str,
    model: str | None,
    max_model_len: int,
    methods: str,
    copy_share: float,
    engine_core: str,
) -> None:
    """Live vs blocking vs recompute downtime by sequence length (torch or vllm engine, two agents).

    The defaults take a few minutes on two cores; the full sweep
    (--seq-lens 256,1024,2048,4096,8192 --repeats 5) takes far longer, most of it in the
    recompute runs' prefills of the long sequences.
    """
    if engine == "vllm" and model is None:
        raise click.UsageError("--engine vllm needs --model CHECKPOINT_FOLDER")
    lengths = [int(part) for part in seq_lens.split(",") if part.strip()]
    chosen = [part.strip() for part in methods.split(",") if part.strip()]
    unknown = sorted(set(chosen) - set(METHODS))
    if unknown or not chosen:
        raise click.UsageError(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    result = run_benchmark(
        seq_lens=lengths,
        repeats=repeats,
        recompute_long_repeats=recompute_long_repeats,
        long_from=long_from,
        preset=preset,
        transport=transport,
        background=background,
        gaps=gaps,
        nats_url=nats_url,
        engine=engine,
        model=model,
        max_model_len=max_model_len,
        methods=chosen,
        copy_share=copy_share,
        engine_core=engine_core,
    )
    click.echo(json.dumps(result["setup"], indent=1))
    click.echo(_table(result["rows"]))
    click.echo(_pacing_table(result["rows"]))
    if json_path is not None:
        rows = [{**row, "setup": result["setup"]} for row in result["rows"]]
        json_path.write_text(json.dumps(rows, indent=1))
    plot = plot_path or (
        json_path.with_suffix(".png") if json_path is not None else Path("bench_migration.png")
    )
    _plot(result["rows"], plot)
    click.echo(f"plot: {plot}")
