"""``shoal bench …``: every benchmark, each defined beside what it measures.

Same lazy scheme as the top-level command: a benchmark whose module does not
exist yet says so instead of running.
"""

from __future__ import annotations

import click

from frontend.cli import LazyGroup

__all__ = ["bench"]

BENCHMARKS: dict[str, tuple[str, str]] = {
    "bus": ("bus.bench:bench_bus", "Append and replay throughput of the bus vs raw nats-py."),
    "engine": ("agents.engines.bench:bench_engine", "Engine tokens/s and KV export/import GB/s."),
    "deltas": ("agents.bench_deltas:bench_deltas", "Token deltas per request vs batched per step."),
    "prefill": ("agents.engines.bench_prefill:bench_prefill", "Decode stall under a long prompt."),
    "step": ("agents.engines.bench_step:bench_step", "Torch engine CPU per prompt token and decode step."),
    "migration": ("agents.bench_migration:bench_migration", "Live vs blocking vs recompute downtime."),
    "cluster": ("scheduler.bench_cluster:bench_cluster", "Dispatch latency at 64 sim instances."),
    "recovery": ("scheduler.bench_recovery:bench_recovery", "Scheduler recovery time by log size."),
    "serve": ("frontend.bench_serve:bench_serve", "Streaming throughput through shoal vs direct."),
    "requeue": ("frontend.bench_requeue:bench_requeue", "Burst TTFT, queued requests moved or not."),
    "tracing": ("frontend.bench_tracing:bench_tracing", "Streaming throughput with tracing on vs off."),
    "vllm-serve": ("frontend.bench_vllm_serve:bench_vllm_serve", "shoal up --engine vllm vs vllm serve."),
}


@click.group(cls=LazyGroup, lazy=BENCHMARKS)
def bench() -> None:
    """Run a benchmark; each prints a table and can write --json."""
