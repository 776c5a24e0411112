"""``shoal bench tracing``: what tracing costs, shoal with tracing off next to tracing on in one run.

Two copies of shoal run side by side, each an embedded nats-server,
``shoal scheduler``, one ``shoal agent`` (the torch preset, as in
``shoal bench serve``) and ``shoal serve`` as child processes:

* **off**: no ``OTEL_*`` variables but ``OTEL_SDK_DISABLED=true``, so no
  process builds a tracer provider (the API's no-op tracer);
* **on**: every process samples every request (``OTEL_TRACES_SAMPLER=always_on``)
  and exports over OTLP/HTTP (``http/protobuf``) to a receiver the bench
  starts as a child process on a free loopback port
  (:class:`bus.otlp_receiver.ReceiverProcess`), which decodes each
  ``ExportTraceServiceRequest`` and counts its spans.

For each concurrency the same streaming workload as ``shoal bench serve``
(that many warm-up requests at once, then that many streams at once) runs ``--rounds`` times
against each side, alternating (off first in even rounds, on first in odd
ones); the run of median throughput of each side is reported. After each run
the bench waits until the receiver has taken nothing new for
``2 x --export-delay-ms + 0.5 s`` (after an off run too), so a run's spans
arrive before the next run starts and the CPU time each process spends per
1000 output tokens, measured over the run and that wait, includes exporting
them. ``--export-delay-ms`` is the SDK's ``OTEL_BSP_SCHEDULE_DELAY`` on the
traced side: 500 ms by default instead of the SDK's 5 s, so that a run of a
few seconds exports while it runs instead of after its clock stopped.

Reported per concurrency: tokens/s off and on and their ratio (the aim:
>= 0.95), TTFT p50/p99 both ways, the spans the receiver took during the on
runs (in all, per request, by name) and during the off runs, CPU ms per 1000
output tokens of each process both ways, and how many requests each side's
frontend placed where the scheduler said and how many by bypass (the same
dispatch path both ways, or the comparison is not like for like). A run in which nothing was
exported (or in which the off side exported) is no measure of tracing: the
command then fails after printing and writing its results.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import urllib.request
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from bus import event_loop
from bus.bench_progress import BenchProgress
from bus.otlp_receiver import ReceiverProcess
from frontend.bench_cli import scratch_dir
from frontend.bench_serve import (
    cpu_seconds,
    drive_streams,
    engine_options,
    median_run,
    process_ids,
    spawn_shoal,
    torch_agent_args,
    wait_ready,
)
from frontend.up import ClusterProcesses

__all__ = ["SIDES", "bench_tracing", "run_tracing_rounds", "traced_environment", "untraced_environment"]

SIDES = ("off", "on")
#: the processes whose CPU time is reported (the bench process is "clients")
PROCESSES = ("agent", "scheduler", "frontend", "nats", "clients", "receiver")


def untraced_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without any ``OTEL_*`` variable, and the SDK disabled: no process traces."""
    return {**{k: v for k, v in environ.items() if not k.startswith("OTEL_")}, "OTEL_SDK_DISABLED": "true"}


def traced_environment(environ: Mapping[str, str], endpoint: str, export_delay_ms: int) -> dict[str, str]:
    """``environ`` with only the bench's ``OTEL_*`` variables: sample everything, export to ``endpoint``."""
    return {
        **{k: v for k, v in environ.items() if not k.startswith("OTEL_")},
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_SAMPLER": "always_on",
        "OTEL_BSP_SCHEDULE_DELAY": str(export_delay_ms),
    }


@dataclass(frozen=True)
class _Side:
    name: str
    processes: ClusterProcesses
    url: str


def _wait_until_quiet(receiver: ReceiverProcess, quiet_s: float, timeout_s: float = 60.0) -> None:
    """Until the receiver's span count has not moved for ``quiet_s`` (at most ``timeout_s``)."""
    started = last_change = time.monotonic()
    last = receiver.stats().spans
    while time.monotonic() - last_change < quiet_s and time.monotonic() - started < timeout_s:
        time.sleep(0.1)
        now = receiver.stats().spans
        if now != last:
            last, last_change = now, time.monotonic()


def _placements(url: str) -> dict[str, float]:
    """The frontend's placement counters: requests placed by the scheduler and by bypass."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        text = response.read().decode()
    counters = {"shoal_scheduler_placements_total": "scheduler_placements",
                "shoal_bypass_placements_total": "bypass_placements"}
    found = dict.fromkeys(counters.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in counters:
                found[counters[sample.name]] = sample.value
    return found


def _run_once(side: _Side, receiver: ReceiverProcess, model: str, concurrency: int, prompt_tokens: int,
              max_tokens: int, offset: int, quiet_s: float) -> tuple[dict[str, float], Counter[str]]:
    """One workload against one side: its figures, and the spans the receiver took meanwhile by name."""
    pids = {**process_ids(side.processes), "clients": os.getpid(), "receiver": receiver.pid}
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    spans_before = receiver.stats()
    placed_before = _placements(side.url)
    result = event_loop.run(drive_streams(side.url, model, concurrency, prompt_tokens, max_tokens, offset))
    _wait_until_quiet(receiver, quiet_s)
    spans_after = receiver.stats()
    for key, value in _placements(side.url).items():  # the warm-up requests included
        result[key] = value - placed_before[key]
    tokens = max(result["tokens"], 1.0)
    for name, pid in pids.items():  # warm-up requests and the export after the run included
        result[f"{name}_cpu_ms_per_ktok"] = 1e6 * (cpu_seconds(pid) - cpu_before[name]) / tokens
    result["spans"] = float(spans_after.spans - spans_before.spans)
    result["export_bytes"] = float(spans_after.bytes - spans_before.bytes)
    by_name = Counter(spans_after.spans_by_name)
    by_name.subtract(spans_before.spans_by_name)
    return result, +by_name


def _start_sides(preset: str, options: dict[str, Any], threads: int, log_dir: Path,
                 environments: dict[str, dict[str, str]]) -> dict[str, _Side]:
    """Both shoals, started at once, in ``environments[side]``; returned when both are ready."""
    clusters = {name: ClusterProcesses(log_dir / name, env=environments[name]) for name in SIDES}
    try:
        sides: dict[str, _Side] = {}
        for name, cluster in clusters.items():
            cluster.log_dir.mkdir(parents=True, exist_ok=True)
            url = spawn_shoal(cluster, agent_args=torch_agent_args(preset, options, threads), model=preset,
                              max_model_len=options["max_model_len"], scheduler=True)
            sides[name] = _Side(name, cluster, url)
        for side in sides.values():
            wait_ready(side.processes, side.url)
        return sides
    except BaseException:
        for cluster in clusters.values():
            cluster.stop_all()
        raise


def run_tracing_rounds(
    preset: str, concurrencies: list[int], prompt_tokens: int, max_tokens: int, threads: int, log_dir: Path,
    *, rounds: int, export_delay_ms: int, environ: Mapping[str, str],
) -> dict[int, dict[str, Any]]:
    """Off and on shoal and the receiver as children; ``rounds`` alternating runs per concurrency."""
    options = engine_options(preset, max(concurrencies), prompt_tokens, max_tokens)
    quiet_s = 2 * export_delay_ms / 1000 + 0.5
    results: dict[int, dict[str, Any]] = {}
    with ReceiverProcess(log_dir / "otlp-receiver.log") as receiver:
        environments = {
            "off": untraced_environment(environ),
            "on": traced_environment(environ, receiver.url, export_delay_ms),
        }
        progress = BenchProgress("tracing", 1 + len(concurrencies) * rounds * len(SIDES))
        progress.phase(f"starting two copies of shoal ({preset}), tracing off and on")
        sides = _start_sides(preset, options, threads, log_dir, environments)
        try:
            for n, concurrency in enumerate(concurrencies):
                runs: dict[str, list[dict[str, float]]] = {name: [] for name in SIDES}
                spans: dict[str, Counter[str]] = {name: Counter() for name in SIDES}
                for round_index in range(rounds):
                    order = SIDES if round_index % 2 == 0 else SIDES[::-1]
                    for name in order:
                        step = f"round {round_index + 1}/{rounds}"
                        progress.phase(f"{concurrency} streams, {step}, tracing {name}")
                        offset = 1000 * (n + 1) + 100 * round_index
                        result, by_name = _run_once(sides[name], receiver, preset, concurrency, prompt_tokens,
                                                    max_tokens, offset, quiet_s)
                        runs[name].append(result)
                        spans[name].update(by_name)
                results[concurrency] = {
                    "runs": runs, "spans_by_name": spans,
                    "median": {name: median_run(runs[name]) for name in SIDES},
                }
        finally:
            for side in reversed(list(sides.values())):
                side.processes.stop_all()
    return results


def _summary(concurrency: int, rounds: int, measured: dict[str, Any]) -> dict[str, Any]:
    off, on = measured["median"]["off"], measured["median"]["on"]
    runs = measured["runs"]
    requests = rounds * 2 * concurrency  # each run sends ``concurrency`` warm-up requests first
    spans_on = int(sum(run["spans"] for run in runs["on"]))
    return {
        "off_tps": off["tps"], "on_tps": on["tps"],
        "ratio": on["tps"] / off["tps"] if off["tps"] else float("nan"),
        "round_ratios": [b["tps"] / a["tps"] for a, b in zip(runs["off"], runs["on"], strict=True)],
        "off_ttft_p50_ms": off["ttft_p50_ms"], "off_ttft_p99_ms": off["ttft_p99_ms"],
        "on_ttft_p50_ms": on["ttft_p50_ms"], "on_ttft_p99_ms": on["ttft_p99_ms"],
        "off_tokens": off["tokens"], "on_tokens": on["tokens"],
        "spans_received": spans_on,
        "spans_per_request": spans_on / requests,
        "spans_by_name": dict(sorted(measured["spans_by_name"]["on"].items())),
        "export_bytes": int(sum(run["export_bytes"] for run in runs["on"])),
        "spans_received_during_off": int(sum(run["spans"] for run in runs["off"])),
        # placements over all runs of each side, warm-up requests included: the dispatch path both took
        "placements": {
            name: {key: int(sum(run[key] for run in runs[name]))
                   for key in ("scheduler_placements", "bypass_placements")}
            for name in SIDES
        },
        "cpu_ms_per_1k_tokens": {
            name: {p: measured["median"][name].get(f"{p}_cpu_ms_per_ktok", 0.0) for p in PROCESSES}
            for name in SIDES
        },
    }


@click.command("tracing")
@click.option("--preset", default="small", show_default=True, help="Torch preset of the engine.")
@click.option("--concurrency", "concurrencies", type=int, multiple=True, default=(32,), show_default=True,
              help="Concurrent streaming clients (repeatable).")
@click.option("--prompt-tokens", type=int, default=32, show_default=True)
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--threads", type=int, default=1, show_default=True, help="Torch threads of each agent.")
@click.option("--rounds", type=int, default=3, show_default=True,
              help="Alternating off/on runs per concurrency; the median of each side is reported.")
@click.option("--export-delay-ms", type=int, default=500, show_default=True,
              help="OTEL_BSP_SCHEDULE_DELAY of the traced side (the SDK's default is 5000).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_tracing(preset: str, concurrencies: tuple[int, ...], prompt_tokens: int, max_tokens: int,
                  threads: int, rounds: int, export_delay_ms: int, json_path: Path | None) -> None:
    """Streaming tokens/s and TTFT through shoal with tracing off vs on (always_on, OTLP/HTTP export).

    The defaults take a few minutes on two cores; more load and tighter medians:
    --concurrency 8 --concurrency 32 --concurrency 64 --rounds 5.
    """
    levels = sorted(set(concurrencies))
    with scratch_dir("shoal-bench-tracing-") as log_dir:  # kept, and named, only if the benchmark fails
        measured = run_tracing_rounds(
            preset, levels, prompt_tokens, max_tokens, threads, log_dir,
            rounds=rounds, export_delay_ms=export_delay_ms, environ=os.environ,
        )
    results = {str(c): _summary(c, rounds, measured[c]) for c in levels}
    machine = platform.processor() or platform.machine()
    click.echo(f"preset {preset}, prompt {prompt_tokens} tokens, {max_tokens} output tokens per request, "
               f"torch threads {threads}, {os.cpu_count()} CPUs, {machine}; "
               f"on: always_on, OTLP http/protobuf, export every {export_delay_ms} ms")
    click.echo(f"{'streams':>8} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>6} {'TTFT p50 off/on':>16} "
               f"{'TTFT p99 off/on':>16} {'spans':>7} {'per req':>8} {'off spans':>9}")
    for c in levels:
        r = results[str(c)]
        click.echo(f"{c:>8} {r['off_tps']:>10.1f} {r['on_tps']:>10.1f} {r['ratio']:>6.2f} "
                   f"{r['off_ttft_p50_ms']:>7.0f} / {r['on_ttft_p50_ms']:<6.0f} "
                   f"{r['off_ttft_p99_ms']:>7.0f} / {r['on_ttft_p99_ms']:<6.0f} "
                   f"{r['spans_received']:>7} {r['spans_per_request']:>8.2f} "
                   f"{r['spans_received_during_off']:>9}")
    click.echo("CPU ms per 1000 output tokens, off -> on (run and export included):")
    for c in levels:
        cpu = results[str(c)]["cpu_ms_per_1k_tokens"]
        click.echo(f"{c:>8} " + ", ".join(f"{p} {cpu['off'][p]:.0f} -> {cpu['on'][p]:.0f}"
                                          for p in PROCESSES))
    click.echo("Requests placed by the scheduler / by bypass, off | on:")
    for c in levels:
        placed = results[str(c)]["placements"]
        click.echo(f"{c:>8} " + " | ".join(
            f"{placed[name]['scheduler_placements']} / {placed[name]['bypass_placements']}" for name in SIDES
        ))
    ratios = [r["ratio"] for r in results.values()]
    meta = {"preset": preset, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "threads": threads,
            "rounds": rounds, "sampler": "always_on", "protocol": "http/protobuf",
            "export_delay_ms": export_delay_ms, "scheduler": True, "load_average": os.getloadavg(),
            "event_loop": event_loop.loop_name(), "cpus": os.cpu_count(), "machine": machine,
            "median_ratio": statistics.median(ratios)}
    if json_path is not None:
        json_path.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        click.echo(f"wrote {json_path}")
    unexported = [c for c in levels if results[str(c)]["spans_received"] == 0]
    leaked = [c for c in levels if results[str(c)]["spans_received_during_off"] != 0]
    if unexported or leaked:
        raise click.ClickException(
            f"not a measure of tracing: no spans received with tracing on at {unexported or 'none'}, "
            f"spans received with tracing off at {leaked or 'none'}"
        )
