"""``shoal bench requeue``: TTFT of a burst with and without moving queued requests, side by side.

Two local clusters run at once, each an embedded nats-server, ``shoal scheduler``
(its default policy), ``--instances`` torch agents (``--max-batch-size``
slots, given per agent in turn: by default 1 and 8) and ``shoal serve``; they differ only in the scheduler's
``--requeue-after-s``. Each round sends the same burst to one cluster, then to
the other (the order alternates by round): ``--requests`` streaming requests at
once, ``--prompt-tokens`` each, a quarter of them ``--long-tokens`` long and
the rest ``--short-tokens`` (seeded: the same burst for both). Dispatch weighs
blocks ahead, not batch slots or output lengths, so the burst is split about
evenly and the instance with one slot queues while the other runs dry: with
the move on, the stalled queue's requests go where they start at once (one
per instance per scheduler tick, each request once). Reported per cluster:
TTFT p50 / p99 / mean (median over rounds), the moves logged (``Dispatched``
with ``requeued_from``) and how many committed, and the 1-minute load average
before and after. Writes ``--json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import click

from bus import event_loop
from bus.bench_progress import BenchProgress
from frontend.bench_cli import scratch_dir
from frontend.bench_serve import percentile, wait_ready
from frontend.up import ClusterProcesses

__all__ = ["bench_requeue"]


def _burst(seed: int, requests: int, long_tokens: int, short_tokens: int) -> list[int]:
    """Output lengths of the burst: a quarter long, in a seeded order."""
    lengths = [long_tokens if i % 4 == 0 else short_tokens for i in range(requests)]
    random.Random(seed).shuffle(lengths)
    return lengths


def _spawn(
    processes: ClusterProcesses,
    agent_args: list[str],
    *,
    slots: tuple[int, ...],
    instances: int,
    requeue_after_s: float | None,
    model: str,
    max_model_len: int,
) -> str:
    from bus.server import EmbeddedNats, free_port

    processes.nats = EmbeddedNats(store_dir=processes.log_dir / "nats-store", die_with_parent=True).start()
    url = processes.nats.url
    # "off" says so: the scheduler moves queued requests by default (0.5 s)
    requeue = ["--requeue-after-s", "0" if requeue_after_s is None else str(requeue_after_s)]
    processes.spawn("scheduler", ["scheduler", "--nats", url, "--log-level", "WARNING", *requeue])
    for index in range(instances):
        processes.spawn(
            f"agent{index}",
            [
                "agent",
                "--nats",
                url,
                "--instance-id",
                f"bench-{index}",
                *agent_args,
                "--max-batch-size",
                str(slots[index % len(slots)]),
                "--transport",
                "tcp",
                "--log-level",
                "WARNING",
            ],
        )
    port = free_port()
    processes.spawn(
        "frontend",
        [
            "serve",
            "--nats",
            url,
            "--model",
            model,
            "--port",
            str(port),
            "--max-model-len",
            str(max_model_len),
        ],
    )
    return f"http://127.0.0.1:{port}"


async def _stream(
    client: Any, url: str, model: str, prompt: list[int], max_tokens: int, started: float
) -> float | None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    ttft: float | None = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if ttft is not None or not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - started
    return ttft


async def _drive(url: str, model: str, lengths: list[int], prompt_tokens: int, offset: int) -> list[float]:
    import httpx

    limits = httpx.Limits(max_connections=len(lengths) + 4, max_keepalive_connections=len(lengths) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        prompts = [
            [(offset + i * 37 + t * 11) % 200 + 32 for t in range(prompt_tokens)] for i in range(len(lengths))
        ]
        ttfts = await asyncio.gather(
            *(_stream(client, url, model, prompts[i], n, started) for i, n in enumerate(lengths))
        )
    return [t for t in ttfts if t is not None]


async def _moves(nats_url: str) -> tuple[int, int]:
    """(moves decided, moves committed) in a cluster's log."""
    from bus import BusConfig, JetStreamBus
    from schemas import Codec, CommitAck, Dispatched, MigrationCause, MigrationStarted, Subjects

    codec = Codec()
    subjects = Subjects("shoal")
    decided, requeue_ids, committed = 0, set(), set()
    async with JetStreamBus(BusConfig(url=nats_url, subjects=subjects, name="bench-requeue")) as bus:
        async with bus.replay(subjects.events_stream) as feed:
            async for stored in feed:
                envelope = codec.decode_or_none(stored.data)
                body = None if envelope is None else envelope.body
                if isinstance(body, Dispatched) and body.requeued_from:
                    decided += 1
                elif isinstance(body, MigrationStarted) and body.cause is MigrationCause.REQUEUE:
                    requeue_ids.add(body.migration_id)
                elif isinstance(body, CommitAck) and body.migration_id in requeue_ids:
                    committed.add(body.migration_id)  # logged twice: the handshake and the claim
    return decided, len(committed)


@click.command("requeue")
@click.option("--instances", type=int, default=2, show_default=True)
@click.option("--preset", default="tiny", show_default=True, help="Torch preset of the engine.")
@click.option(
    "--max-batch-size",
    "slots",
    type=int,
    multiple=True,
    default=(1, 8),
    show_default=True,
    help="Slots of each agent in turn (repeat it): dispatch weighs blocks, not slots.",
)
@click.option("--requests", type=int, default=24, show_default=True, help="Requests per burst.")
@click.option("--prompt-tokens", type=int, default=64, show_default=True)
@click.option("--long-tokens", type=int, default=128, show_default=True)
@click.option("--short-tokens", type=int, default=32, show_default=True)
@click.option("--requeue-after-s", type=float, default=0.3, show_default=True)
@click.option("--rounds", type=int, default=3, show_default=True)
@click.option("--threads", type=int, default=1, show_default=True, help="Torch threads per agent.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_requeue(**options: Any) -> None:
    """TTFT of a burst with and without --requeue-after-s, two clusters side by side.

    The defaults take under a minute on two cores; tighter medians: --rounds 7.
    """
    max_model_len = options["prompt_tokens"] + options["long_tokens"] + 32
    agent_args = [
        "--engine",
        "torch",
        "--model",
        options["preset"],
        "--threads",
        str(options["threads"]),
        "--max-model-len",
        str(max_model_len),
    ]
    modes: dict[str, float | None] = {"off": None, "on": options["requeue_after_s"]}
    with scratch_dir("shoal-bench-requeue-") as log_root:
        clusters = {mode: ClusterProcesses(log_root / mode) for mode in modes}
        for processes in clusters.values():
            processes.log_dir.mkdir(parents=True, exist_ok=True)
        load_before = os.getloadavg()[0]
        runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
        moves: dict[str, tuple[int, int]] = {}
        progress = BenchProgress("requeue", 2 + 2 * options["rounds"])
        try:
            agents = f"{options['instances']} torch agents ({options['preset']})"
            progress.phase(f"starting two clusters of {agents}")
            urls = {
                mode: _spawn(
                    clusters[mode],
                    agent_args,
                    slots=options["slots"],
                    instances=options["instances"],
                    requeue_after_s=after,
                    model=options["preset"],
                    max_model_len=max_model_len,
                )
                for mode, after in modes.items()
            }
            for mode in modes:
                wait_ready(clusters[mode], urls[mode], instances=options["instances"])
            progress.phase("warm-up: one request to each cluster")
            for mode in modes:  # warm-up: one request each
                event_loop.run(_drive(urls[mode], options["preset"], [4], options["prompt_tokens"], 999))
            for round_index in range(options["rounds"]):
                lengths = _burst(
                    round_index, options["requests"], options["long_tokens"], options["short_tokens"]
                )
                order = list(modes) if round_index % 2 == 0 else list(reversed(modes))
                for mode in order:
                    progress.phase(
                        f"round {round_index + 1}/{options['rounds']}: a burst of {options['requests']}, "
                        f"requeue {mode}"
                    )
                    time.sleep(1.0)  # let the previous burst's reports settle
                    ttfts = event_loop.run(
                        _drive(
                            urls[mode], options["preset"], lengths, options["prompt_tokens"],
                            1000 * round_index,
                        )
                    )
                    runs[mode].append(
                        {
                            "ttft_p50_s": percentile(ttfts, 0.5),
                            "ttft_p99_s": percentile(ttfts, 0.99),
                            "ttft_mean_s": statistics.fmean(ttfts),
                            "num_ttfts": float(len(ttfts)),
                        }
                    )
                    last = runs[mode][-1]
                    progress.note(f"TTFT p50 {last['ttft_p50_s']:.2f}s p99 {last['ttft_p99_s']:.2f}s")
            for mode in modes:
                nats = clusters[mode].nats
                assert nats is not None
                moves[mode] = event_loop.run(_moves(nats.url))
        finally:
            for processes in clusters.values():
                processes.stop_all()
    load_after = os.getloadavg()[0]
    summary = {
        mode: {key: statistics.median(run[key] for run in runs[mode]) for key in runs[mode][0]}
        for mode in modes
    }
    slots = "/".join(map(str, options["slots"]))
    click.echo(
        f"{options['instances']} torch agents ({options['preset']}, slots {slots}), "
        f"burst of {options['requests']} ({options['prompt_tokens']}-token prompts, a quarter "
        f"{options['long_tokens']} tokens long, the rest {options['short_tokens']}), "
        f"{options['rounds']} rounds, medians; load average {load_before:.1f} -> {load_after:.1f} "
        f"on {os.cpu_count()} cores"
    )
    click.echo(f"{'requeue':<12}{'TTFT p50':>10}{'TTFT p99':>10}{'mean':>10}{'moves':>8}{'committed':>11}")
    for mode, after in modes.items():
        label = "off" if after is None else f"after {after:g}s"
        row = summary[mode]
        click.echo(
            f"{label:<12}{row['ttft_p50_s']:>9.2f}s{row['ttft_p99_s']:>9.2f}s{row['ttft_mean_s']:>9.2f}s"
            f"{moves[mode][0]:>8}{moves[mode][1]:>11}"
        )
    ratio = summary["off"]["ttft_p99_s"] / summary["on"]["ttft_p99_s"]
    click.echo(f"P99 TTFT off/on: {ratio:.2f}x")
    if options["json_path"] is not None:
        options["json_path"].write_text(
            json.dumps(
                {
                    "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in options.items()},
                    "runs": runs,
                    "summary": summary,
                    "moves": {m: {"decided": d, "committed": c} for m, (d, c) in moves.items()},
                    "p99_ratio_off_on": ratio,
                    "load_average": [load_before, load_after],
                    "cpus": os.cpu_count(),
                },
                indent=2,
            )
        )
