"""``shoal bench prefix --mode vllm-repetition``: ``vllm bench serve --dataset-name
prefix_repetition`` (prompts sharing one of a few prefixes) against ``shoal up --engine vllm`` and
against ``vllm serve --enable-prefix-caching``, one server at a time, with the machinery of
:mod:`frontend.bench_vllm_serve`; needs vLLM (``./install.sh --vllm``)."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from bus.bench_progress import BenchProgress
from bus.server import free_port
from frontend.bench_prefix_report import (
    CacheCounters,
    median_known,
    parse_cache_counters,
    scrape_cache_counters,
)
from frontend.bench_prefix_runner import agent_metrics_urls, spawn_server, wait_instances
from frontend.bench_vllm_serve import EngineOptions, Server, parse_result, run_client

__all__ = [
    "Repetition",
    "repetition_client_command",
    "repetition_mode",
    "shoal_vllm_command",
    "vllm_serve_command",
]

_SHOAL = [sys.executable, "-c", "from frontend.cli import main; main()"]
_VLLM = [sys.executable, "-m", "agents.engines.vllm_engine.vllm_cli"]


# ------------------------------------------------------------------------------ vllm-repetition mode


@dataclass(frozen=True)
class Repetition:
    """``vllm bench serve --dataset-name prefix_repetition``'s workload."""

    num_prompts: int = 32
    num_prefixes: int = 4
    prefix_len: int = 512
    suffix_len: int = 64
    output_len: int = 32
    concurrency: int = 4
    seed: int = 0


def vllm_serve_command(options: EngineOptions, port: int) -> list[str]:
    """``vllm serve`` with vLLM's prefix caching on (the other options as ``shoal bench vllm-serve``'s, but
    its stats kept: ``--disable-log-stats`` would leave its prefix-cache counters at 0)."""
    return [
        *_VLLM,
        "serve",
        str(options.model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(options.max_model_len),
        "--block-size",
        str(options.block_size),
        "--kv-cache-memory-bytes",
        str(options.kv_cache_bytes),
        "--dtype",
        options.dtype,
        "--enforce-eager",
        "--enable-prefix-caching",
    ]


def shoal_vllm_command(options: EngineOptions, port: int, log_dir: Path) -> list[str]:
    """``shoal up --engine vllm`` with one agent (its engine's prefix caching as the agent sets it)."""
    return [
        *_SHOAL,
        "up",
        "--engine",
        "vllm",
        "--model",
        str(options.model),
        "--instances",
        "1",
        "--port",
        str(port),
        "--max-model-len",
        str(options.max_model_len),
        "--block-size",
        str(options.block_size),
        "--kv-cache-bytes",
        str(options.kv_cache_bytes),
        "--dtype",
        options.dtype,
        "--log-dir",
        str(log_dir),
        "--ready-timeout",
        "600",
    ]


def repetition_client_command(
    url: str, options: EngineOptions, workload: Repetition, result_dir: Path, result_name: str
) -> list[str]:
    """``vllm bench serve`` with the prefix-repetition dataset against ``url``, its result saved."""
    return [
        *_VLLM,
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        str(options.model),
        "--tokenizer",
        str(options.model),
        "--dataset-name",
        "prefix_repetition",
        "--num-prompts",
        str(workload.num_prompts),
        "--prefix-repetition-num-prefixes",
        str(workload.num_prefixes),
        "--prefix-repetition-prefix-len",
        str(workload.prefix_len),
        "--prefix-repetition-suffix-len",
        str(workload.suffix_len),
        "--prefix-repetition-output-len",
        str(workload.output_len),
        "--ignore-eos",
        "--max-concurrency",
        str(workload.concurrency),
        "--seed",
        str(workload.seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_name,
    ]


def _vllm_metrics_counters(url: str) -> CacheCounters | None:
    """vLLM's own ``vllm:prefix_cache_queries`` / ``_hits`` (its ``/metrics``), as :class:`CacheCounters`."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5.0) as response:
            text = response.read().decode()
    except OSError:
        return None
    return parse_cache_counters(text.replace("vllm:", "vllm_"))


def _server_counters(server: Server) -> CacheCounters | None:
    """A server's prefix-cache counters: vLLM's own, or the agents' of a ``shoal up``."""
    if server.kind == "vllm":
        return _vllm_metrics_counters(server.url)
    return scrape_cache_counters(agent_metrics_urls(server.log_path.read_text(errors="replace")))


def repetition_mode(
    log_dir: Path,
    model: Path | None,
    workload: Repetition,
    rounds: int,
    ready_timeout: float,
    client_timeout: float,
    json_path: Path | None,
) -> None:
    from agents.engines.vllm_engine import vllm_unavailable_reason, vllm_version

    reason = vllm_unavailable_reason()
    if reason is not None:
        raise click.ClickException(reason)
    log_dir.mkdir(parents=True, exist_ok=True)
    if model is None:
        from agents.engines.vllm_engine.checkpoint import build_checkpoint

        model = build_checkpoint(log_dir / "checkpoint")
    options = EngineOptions(model.resolve(), 2048, 32, 2**30, "auto")
    kinds = ("vllm", "shoal")
    progress = BenchProgress("prefix", 2 * rounds)
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for round_index in range(rounds):
        order = kinds if round_index % 2 == 0 else kinds[::-1]
        for kind in order:
            progress.phase(f"round {round_index + 1}/{rounds}: {kind}, vllm bench serve prefix_repetition")
            port = free_port()
            command = (
                vllm_serve_command(options, port)
                if kind == "vllm"
                else shoal_vllm_command(options, port, log_dir / f"up-{round_index}")
            )
            server = spawn_server(kind, command, f"http://127.0.0.1:{port}", log_dir / f"{kind}-{port}.log")
            try:
                if kind == "vllm":
                    server.wait_ready(ready_timeout)
                else:
                    wait_instances(server, 1, ready_timeout)
                before = _server_counters(server)
                name = f"{kind}-r{round_index}.json"
                run_client(
                    repetition_client_command(server.url, options, workload, log_dir, name),
                    log_dir / f"client-{kind}.log",
                    client_timeout,
                )
                after = _server_counters(server)
            finally:
                server.stop()
            result: dict[str, Any] = dict(parse_result(log_dir / name))
            result["hit_rate"] = (
                (after - before).hit_rate if before is not None and after is not None else None
            )
            runs[kind].append(result)
            progress.note(
                f"{kind}: TTFT p50 {result['ttft_p50_ms']:.0f} ms, {result['output_tps']:.0f} tok/s"
            )
    progress.finish()
    results = {
        kind: {key: median_known([r.get(key) for r in runs[kind]]) for key in runs[kind][0]} for kind in kinds
    }
    for kind in kinds:
        r = results[kind]
        rate = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%"
        click.echo(
            f"{kind:>6}: TTFT p50 {r['ttft_p50_ms']:.1f} ms, p99 {r['ttft_p99_ms']:.1f} ms, "
            f"{r['output_tps']:.1f} tok/s, prefix-cache hit rate {rate}"
        )
    meta = {
        "mode": "vllm-repetition",
        "workload": asdict(workload),
        "rounds": rounds,
        "vllm_version": vllm_version(),
        "cpus": os.cpu_count(),
        "commands": {
            "vllm": vllm_serve_command(options, 0),
            "shoal": shoal_vllm_command(options, 0, log_dir),
            "client": repetition_client_command("URL", options, workload, log_dir, "R"),
        },
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"meta": meta, "results": results, "runs": runs}, indent=2))
        click.echo(f"wrote {json_path}")
