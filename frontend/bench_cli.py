"""``shoal bench …``: every benchmark, each defined beside what it measures.

Same lazy scheme as the top-level command: a benchmark's module is imported
only when that benchmark runs.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click

from frontend.cli import LazyGroup

__all__ = ["bench", "scratch_dir"]

BENCHMARKS: dict[str, tuple[str, str]] = {
    "bus": ("bus.bench:bench_bus", "Append and replay throughput of the bus vs raw nats-py."),
    "engine": ("agents.engines.bench:bench_engine", "Engine tokens/s and KV export/import GB/s."),
    "deltas": ("agents.bench_deltas:bench_deltas", "Token deltas per request vs batched per step."),
    "prefill": ("agents.engines.bench_prefill:bench_prefill", "Decode stall under a long prompt."),
    "step": ("agents.engines.bench_step:bench_step", "Torch engine CPU per prompt token and decode step."),
    "migration": ("agents.bench_migration:bench_migration", "Live vs blocking vs recompute downtime."),
    "cluster": ("scheduler.bench_cluster:bench_cluster", "Dispatch latency at 64 sim instances."),
    "dispatch": ("scheduler.bench_dispatch_cpu:bench_dispatch", "CPU per dispatch of each policy by size."),
    "recovery": ("scheduler.bench_recovery:bench_recovery", "Scheduler recovery time by log size."),
    "serve": ("frontend.bench_serve:bench_serve", "Streaming throughput through shoal vs direct."),
    "requeue": ("frontend.bench_requeue:bench_requeue", "Burst TTFT, queued requests moved or not."),
    "tracing": ("frontend.bench_tracing:bench_tracing", "Streaming throughput with tracing on vs off."),
    "vllm-serve": ("frontend.bench_vllm_serve:bench_vllm_serve", "shoal up --engine vllm vs vllm serve."),
    "path-cpu": ("frontend.bench_path_sim:bench_path_cpu", "Path CPU and bus messages per request (sim)."),
    "prefix": ("frontend.bench_prefix:bench_prefix", "Multi-turn chats: TTFT, hit rate, cache on vs off."),
}


#: the signals that stopped this benchmark (set by the SIGTERM handler)
_stopped: list[int] = []


@click.group(cls=LazyGroup, lazy=BENCHMARKS)
def bench() -> None:
    """Run a benchmark; each prints a table and can write --json."""
    _stop_on_sigterm()


def _stop_on_sigterm() -> None:
    """SIGTERM ends a benchmark as Ctrl-C does, so its ``finally`` blocks stop what it started.

    Left at its default, SIGTERM would end the benchmark at once, and its children would get
    SIGTERM from the kernel (``PR_SET_PDEATHSIG``): an agent takes that as a drain, which waits for
    a NATS that died too.
    """

    def handler(signum: int, frame: Any) -> None:
        _stopped.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A temporary folder for a benchmark's child logs and NATS store.

    Removed when the benchmark finishes or is stopped (Ctrl-C, SIGTERM). Kept when the
    benchmark fails, for the logs; its path then goes to stderr.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException as exc:
        # stopped (Ctrl-C, SIGTERM), however the interruption surfaced (a stop can end in another
        # error as the children go): removed; failed on its own: kept for its logs
        if isinstance(exc, KeyboardInterrupt) or _stopped:
            shutil.rmtree(path, ignore_errors=True)
        else:
            click.echo(f"logs kept in {path}", err=True)
        raise
    shutil.rmtree(path, ignore_errors=True)
