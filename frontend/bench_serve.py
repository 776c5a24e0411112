"""``shoal bench serve``: streaming throughput and TTFT through shoal next to the engine driven directly.

For each concurrency (default 8, 32, 64) the same workload — that many
requests of ``--prompt-tokens`` prompt tokens and ``--max-tokens`` output
tokens each (``ignore_eos``, greedy), all sent at once — runs both ways,
alternately ``--rounds`` times (the run of median throughput of each side is
reported, so both sides see the same background load on a shared machine):

* **direct**: a torch engine of the preset in this process, stepped in a loop
  (``add_request`` all, ``step()`` until done): the ceiling; with
  ``--instances N``, N such engines in N processes at once, each with its
  share of the requests (their tokens/s add up);
* **shoal**: an embedded nats-server, ``--instances`` ``shoal agent`` s (same
  engine options and torch thread count) and ``shoal serve`` as child
  processes, and that many concurrent streaming HTTP clients in this process
  (aiohttp, SSE with ``include_usage``; their connections opened by a burst of
  warm-up requests first).

Reported per concurrency: output tokens/s of each (``shoal_tps``,
``direct_tps``) and their ratio, and shoal's TTFT p50/p99 (time to the first
SSE chunk with a choice, text or not, as ``vllm bench serve`` counts it) next
to the direct engine's (time to the first token), and the CPU time each
process spends per 1000 output tokens (which, unlike wall-clock rates, hardly
depends on what else runs on the machine). ``cpu_ceiling_ratio`` is the direct
engines' CPU per token over all of shoal's (agents, frontend, NATS, clients):
where the engines alone keep every core busy (``--instances`` x ``--threads``
>= the cores), tokens/s go as 1 / CPU per token and shoal's ratio cannot pass it.
The shoal run's agent, frontend, NATS and clients all compete for the cores.

Each round is also reported as a pair (shoal and the direct engine one right
after the other, the direct engine first every other round):
its ratio, and where shoal's wall went (:mod:`frontend.bench_steps`): more
steps, a longer step (the same work computing slower), or the engine idle
between steps; the agents' step totals come from their ``/metrics``.

With ``--grammar`` (or ``--json-schema FILE``) every round also sends the same
burst through shoal with a ``json_schema`` ``response_format`` on every
request, right beside the plain one (which goes first alternates by round):
the throughput cost of the grammar's token mask, as paired ratios of tokens/s
and of the agents' CPU per output token (which depends less on what else runs
on the machine). The
built-in schema (:data:`BENCH_SCHEMA`, records of integers, bounded strings,
numbers, an enum and a short array) needs more tokens than any ``--max-tokens``
to complete, so both sides generate exactly ``--max-tokens`` per request.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from bus import event_loop
from bus.bench_progress import BenchProgress
from frontend.bench_cli import scratch_dir
from frontend.bench_steps import StepTotals, breakdown_table, scrape_step_totals, step_breakdown
from frontend.up import ClusterProcesses, _health

__all__ = [
    "BENCH_SCHEMA", "bench_serve", "child_pids", "cpu_seconds", "drive_streams", "engine_options",
    "median_run", "percentile", "process_ids", "response_format_of", "run_direct", "run_through_shoal",
    "spawn_shoal", "start_shoal", "torch_agent_args", "wait_ready",
]


#: ``--grammar``'s schema: an array of at least 4096 records of 40 characters or more, so the
#: output never completes within a run's ``--max-tokens`` and the grammar constrains every token
BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"records": {"type": "array", "minItems": 4096, "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "name": {"type": "string", "maxLength": 16},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "kind": {"enum": ["user", "admin", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        },
        "required": ["id", "name", "score", "kind", "tags"],
        "additionalProperties": False,
    }}},
    "required": ["records"],
    "additionalProperties": False,
}


def response_format_of(schema: dict[str, Any]) -> dict[str, Any]:
    """The request fields that put ``schema`` on a request (OpenAI's ``response_format``)."""
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "bench", "schema": schema, "strict": True}}}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def cpu_seconds(pid: int, *, children: bool = False) -> float:
    """User + system CPU seconds a process has used (all its threads), from /proc; 0.0 if unknown.

    ``children``: with its live child processes' (an agent's engine core process).
    """
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(cpu_seconds(child) for child in child_pids(pid)) if children else own


def child_pids(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _prompt(index: int, length: int) -> list[int]:
    return [(index * 37 + t * 11) % 200 + 32 for t in range(length)]


def engine_options(preset: str, concurrency: int, prompt_tokens: int, max_tokens: int) -> dict[str, Any]:
    per_request = -(-(prompt_tokens + max_tokens + 1) // 16) + 1
    return {"model": preset, "num_blocks": per_request * concurrency + 8, "max_batch_size": concurrency,
            "max_model_len": prompt_tokens + max_tokens + 32}


def run_direct(preset: str, concurrency: int, prompt_tokens: int, max_tokens: int) -> dict[str, float]:
    """The engine alone in this process: tokens/s and TTFT of ``concurrency`` simultaneous requests."""
    from agents.engines.torch_engine import TorchEngine, TorchEngineConfig
    from schemas import SamplingParams

    engine = TorchEngine(TorchEngineConfig(**engine_options(preset, concurrency, prompt_tokens, max_tokens)))
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    engine.add_request("warmup", _prompt(999, prompt_tokens), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    started = time.perf_counter()
    cpu_before = time.process_time()
    for index in range(concurrency):
        engine.add_request(f"d{index}", _prompt(index, prompt_tokens), sampling)
    first: dict[str, float] = {}
    total = 0
    steps, step_s = 0, 0.0
    while engine.has_unfinished():
        result = engine.step()
        now = time.perf_counter()
        if result.num_scheduled:  # as an agent's step histogram counts them
            steps, step_s = steps + 1, step_s + result.duration_s
        for output in result.outputs:
            total += len(output.token_ids)
            if output.token_ids:
                first.setdefault(output.request_id, now - started)
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_before
    ttfts = list(first.values())
    return {"tps": total / wall, "tokens": float(total), "wall_s": wall, "cpu_ms_per_ktok": 1e6 * cpu / total,
            "ttft_p50_ms": 1000 * percentile(ttfts, 0.5), "ttft_p99_ms": 1000 * percentile(ttfts, 0.99),
            "steps": float(steps), "step_s": step_s}


async def _one_stream(session: Any, url: str, model: str, prompt: list[int], max_tokens: int,
                      started: float, extra: dict[str, Any] | None = None) -> tuple[float | None, int, float]:
    """One streaming completion: (TTFT, output tokens, when its request was sent, all from ``started``);
    ``extra``: more request fields (a ``response_format``)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    ttft: float | None = None
    tokens = 0
    sent = time.perf_counter() - started
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):  # the first token, text or not (as vllm bench serve)
                ttft = time.perf_counter() - started
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    return ttft, tokens, sent


async def drive_streams(url: str, model: str, concurrency: int, prompt_tokens: int, max_tokens: int,
                        offset: int, before_burst: Callable[[], None] | None = None,
                        extra: dict[str, Any] | None = None) -> dict[str, float]:
    """``concurrency`` warm-up requests at once (the client's connections open and stay open, as a
    serving client's would), then ``concurrency`` streams at once: tokens/s and TTFT over them.
    ``before_burst`` runs between the two, before the clock starts. ``extra``: more fields on every
    request, warm-up ones included (a ``response_format``: the engine compiles its grammar then).

    The client is aiohttp, as in ``vllm bench serve``: with httpx's pool the 32 requests of
    one burst left the client over 250-800 ms on a loaded 2-core machine (aiohttp: under 60 ms),
    a ramp the engine driven directly never pays. ``send_spread_ms`` reports the client's own ramp.
    """
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(
            _one_stream(session, url, model, _prompt(998 - i, prompt_tokens), 1, time.perf_counter(), extra)
            for i in range(concurrency)
        ))
        if before_burst is not None:
            before_burst()
        started = time.perf_counter()
        results = await asyncio.gather(*(
            _one_stream(session, url, model, _prompt(offset + i, prompt_tokens), max_tokens, started, extra)
            for i in range(concurrency)
        ))
        wall = time.perf_counter() - started
    ttfts = [t for t, _, _ in results if t is not None]
    total = sum(n for _, n, _ in results)
    sent = [s for _, _, s in results]
    return {"tps": total / wall, "tokens": float(total), "wall_s": wall,
            "ttft_p50_ms": 1000 * percentile(ttfts, 0.5), "ttft_p99_ms": 1000 * percentile(ttfts, 0.99),
            "send_spread_ms": 1000 * (max(sent) - min(sent))}


def _direct_share(args: tuple[str, int, int, int, int]) -> dict[str, float]:
    preset, concurrency, prompt_tokens, max_tokens, threads = args
    import torch

    torch.set_num_threads(threads)
    return run_direct(preset, concurrency, prompt_tokens, max_tokens)


def run_direct_instances(
    preset: str, concurrency: int, prompt_tokens: int, max_tokens: int, *, instances: int, threads: int
) -> dict[str, float]:
    """:func:`run_direct` on ``instances`` engines at once, one process each, the requests split evenly."""
    if instances == 1:
        return run_direct(preset, concurrency, prompt_tokens, max_tokens)
    import concurrent.futures
    import multiprocessing

    shares = [concurrency // instances + (1 if i < concurrency % instances else 0) for i in range(instances)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(instances, mp_context=context) as pool:
        jobs = [(preset, n, prompt_tokens, max_tokens, threads) for n in shares]
        parts = list(pool.map(_direct_share, jobs))
    tokens = sum(p["tokens"] for p in parts)
    return {"tps": sum(p["tps"] for p in parts), "tokens": tokens, "wall_s": max(p["wall_s"] for p in parts),
            "cpu_ms_per_ktok": sum(p["cpu_ms_per_ktok"] * p["tokens"] for p in parts) / tokens,
            "ttft_p50_ms": statistics.median(p["ttft_p50_ms"] for p in parts),
            "ttft_p99_ms": max(p["ttft_p99_ms"] for p in parts),
            "steps": sum(p["steps"] for p in parts), "step_s": sum(p["step_s"] for p in parts)}


def _streams_and_steps(url: str, metrics_urls: list[str], model: str, concurrency: int, prompt_tokens: int,
                       max_tokens: int, offset: int, extra: dict[str, Any] | None = None) -> dict[str, float]:
    """:func:`drive_streams`, with the agents' steps and step seconds during the burst."""
    marks: list[StepTotals] = []
    result = event_loop.run(drive_streams(
        url, model, concurrency, prompt_tokens, max_tokens, offset,
        before_burst=lambda: marks.append(scrape_step_totals(metrics_urls)), extra=extra,
    ))
    steps = scrape_step_totals(metrics_urls) - marks[0]
    result["steps"], result["step_s"] = float(steps.steps), steps.seconds
    return result


def _pair(shoal: dict[str, float], direct: dict[str, float], instances: int) -> dict[str, float]:
    """One round: shoal's tokens/s over the direct engine's run beside it, and why."""
    return {"ratio": shoal["tps"] / direct["tps"] if direct["tps"] else float("nan"),
            "direct_first": shoal["direct_first"],
            **step_breakdown(StepTotals(int(shoal["steps"]), shoal["step_s"]), shoal["wall_s"],
                             StepTotals(int(direct["steps"]), direct["step_s"]), direct["wall_s"],
                             instances=instances)}


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median throughput (its TTFTs and CPU figures come with it)."""
    return sorted(runs, key=lambda run: run["tps"])[len(runs) // 2]


def torch_agent_args(
    preset: str, options: dict[str, Any], threads: int, engine_core: str = "thread"
) -> list[str]:
    """``shoal agent``'s engine options for a torch preset sized by :func:`engine_options`."""
    return ["--engine", "torch", "--model", preset, "--threads", str(threads), "--engine-core", engine_core,
            "--num-blocks", str(options["num_blocks"]), "--max-batch-size", str(options["max_batch_size"]),
            "--max-model-len", str(options["max_model_len"])]


def start_shoal(
    processes: ClusterProcesses, *, agent_args: Sequence[str], model: str, max_model_len: int,
    scheduler: bool = False, ready_timeout: float = 180.0, instances: int = 1,
    agent_metrics_ports: Sequence[int] = (),
) -> str:
    """:func:`spawn_shoal`, then :func:`wait_ready`: the frontend's URL once it sees the agents ready."""
    url = spawn_shoal(processes, agent_args=agent_args, model=model, max_model_len=max_model_len,
                      scheduler=scheduler, instances=instances, agent_metrics_ports=agent_metrics_ports)
    wait_ready(processes, url, ready_timeout, instances=instances)
    return url


def spawn_shoal(
    processes: ClusterProcesses, *, agent_args: Sequence[str], model: str, max_model_len: int,
    scheduler: bool = False, instances: int = 1, agent_metrics_ports: Sequence[int] = (),
) -> str:
    """Shoal as children of ``processes``: an embedded NATS, ``shoal scheduler`` if asked,
    ``instances`` ``shoal agent`` s (``agent_args``: their engine options; ids ``bench-0``, ...;
    agent ``i`` serves ``/metrics`` on 127.0.0.1 port ``agent_metrics_ports[i]`` where given)
    and ``shoal serve``, in ``processes.env``.

    Returns the frontend's URL at once. Call it from the main thread: each child is told to
    exit when the thread that started it ends (``PR_SET_PDEATHSIG``).
    """
    from bus.server import EmbeddedNats, free_port

    processes.nats = EmbeddedNats(store_dir=processes.log_dir / "nats-store", die_with_parent=True).start()
    url = processes.nats.url
    port = free_port()
    if scheduler:
        processes.spawn("scheduler", ["scheduler", "--nats", url, "--log-level", "WARNING"])
    for index in range(instances):
        metrics = ([] if index >= len(agent_metrics_ports) else
                   ["--metrics-port", str(agent_metrics_ports[index]), "--metrics-host", "127.0.0.1"])
        processes.spawn("agent" if index == 0 else f"agent{index}", [
            "agent", "--nats", url, "--instance-id", f"bench-{index}", *agent_args, "--transport", "tcp",
            "--log-level", "WARNING", *metrics,
        ])
    # without a scheduler a dispatch has no responders at once; with one, the frontend's default wait
    dispatch_timeout = [] if scheduler else ["--dispatch-timeout", "0.2"]
    processes.spawn("frontend", [
        "serve", "--nats", url, "--model", model, "--port", str(port), "--max-model-len", str(max_model_len),
        *dispatch_timeout,
    ])
    return f"http://127.0.0.1:{port}"


def wait_ready(
    processes: ClusterProcesses, url: str, ready_timeout: float = 180.0, *, instances: int = 1
) -> None:
    """Until the frontend at ``url`` lists ``instances`` ready instances.

    Fails if a child dies or time runs out.
    """
    deadline = time.monotonic() + ready_timeout
    while True:
        health = _health(url)
        if health is not None and len(health.get("instances") or ()) >= instances:
            return
        if time.monotonic() > deadline or processes.newly_dead():
            raise click.ClickException(f"shoal did not start; logs in {processes.log_dir}")
        time.sleep(0.2)


def process_ids(processes: ClusterProcesses) -> dict[str, int]:
    """Each child's pid by name, and the embedded NATS server's as ``nats``."""
    pids = {c.name: c.pid for c in processes.children}
    if processes.nats is not None:
        pids["nats"] = processes.nats.pid
    return pids


def run_through_shoal(
    preset: str, concurrencies: list[int], prompt_tokens: int, max_tokens: int, threads: int, log_dir: Path,
    *, rounds: int = 1, instances: int = 1, engine_core: str = "thread", schema: dict[str, Any] | None = None,
) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]], dict[int, list[dict[str, float]]],
           dict[int, dict[str, Any]]]:
    """``instances`` agents and the frontend as child processes on an embedded NATS; clients here.

    Each concurrency runs ``rounds`` times through shoal, each next to a run of
    the direct engine on the same workload (after it, or before it every other
    round), so both see the same load on a shared machine; the run of median
    throughput of each side is reported.
    With ``schema``, each round also runs the burst through shoal with that JSON schema as every
    request's ``response_format``, beside the plain one (the plain one first every other round).
    Returns ``(shoal, direct, pairs, grammar)`` by concurrency: the median runs, per round its
    paired ratio and :func:`~frontend.bench_steps.step_breakdown`, and (with ``schema``) the
    constrained runs: their median run, and each round's tokens/s and agent CPU per token over the
    plain run's.
    """
    from bus.server import free_port

    options = engine_options(preset, max(concurrencies), prompt_tokens, max_tokens)
    processes = ClusterProcesses(log_dir)
    progress = BenchProgress("serve", 1 + len(concurrencies) * rounds)
    extra = None if schema is None else response_format_of(schema)
    try:
        progress.phase(f"starting shoal: NATS, {instances} agent(s) ({preset}), the frontend")
        agent_args = torch_agent_args(preset, options, threads, engine_core)
        ports = [free_port() for _ in range(instances)]
        metrics_urls = [f"http://127.0.0.1:{port}/metrics" for port in ports]
        http_url = start_shoal(processes, agent_args=agent_args, model=preset,
                               max_model_len=options["max_model_len"], instances=instances,
                               agent_metrics_ports=ports)
        shoal: dict[int, dict[str, float]] = {}
        direct: dict[int, dict[str, float]] = {}
        pairs: dict[int, list[dict[str, float]]] = {}
        grammar: dict[int, dict[str, Any]] = {}
        pids = process_ids(processes)
        pids["clients"] = os.getpid()

        def run_direct_now(concurrency: int) -> dict[str, float]:
            return run_direct_instances(
                preset, concurrency, prompt_tokens, max_tokens, instances=instances, threads=threads
            )

        def cpu(name: str, pid: int) -> float:  # an agent's engine core process counts as the agent's
            return cpu_seconds(pid, children=name.startswith("agent"))

        def through_shoal(concurrency: int, offset: int, fields: dict[str, Any] | None) -> dict[str, float]:
            before = {name: cpu(name, pid) for name, pid in pids.items()}
            result = _streams_and_steps(http_url, metrics_urls, preset, concurrency, prompt_tokens,
                                        max_tokens, offset, fields)
            for name, pid in pids.items():  # CPU ms per 1000 output tokens, warm-up requests included
                result[f"{name}_cpu_ms_per_ktok"] = (
                    1e6 * (cpu(name, pid) - before[name]) / max(result["tokens"], 1.0)
                )
            result["agent_cpu_ms_per_ktok"] = sum(  # all agents together
                result.pop(f"{name}_cpu_ms_per_ktok") for name in list(pids) if name.startswith("agent")
            )
            return result

        for n, concurrency in enumerate(concurrencies):
            shoal_runs, direct_runs, grammar_runs = [], [], []
            for round_index in range(rounds):
                # every other round the direct engine goes first, so a drift in the machine's speed
                # during a round does not always fall on the same side
                direct_first = round_index % 2 == 1
                progress.phase(f"{concurrency} streams, round {round_index + 1}/{rounds}: shoal and direct")
                if direct_first:
                    direct_runs.append(run_direct_now(concurrency))
                offset = 1000 * (n + 1) + 100 * round_index
                if extra is not None and direct_first:  # the constrained run beside the plain one
                    grammar_runs.append(through_shoal(concurrency, offset, extra))
                result = through_shoal(concurrency, offset, None)
                result["direct_first"] = float(direct_first)
                shoal_runs.append(result)
                if extra is not None and not direct_first:
                    grammar_runs.append(through_shoal(concurrency, offset, extra))
                if not direct_first:
                    direct_runs.append(run_direct_now(concurrency))
            shoal[concurrency] = median_run(shoal_runs)
            direct[concurrency] = median_run(direct_runs)
            pairs[concurrency] = [
                _pair(s, d, instances) for s, d in zip(shoal_runs, direct_runs, strict=True)
            ]
            if grammar_runs:
                grammar[concurrency] = {
                    "median_run": median_run(grammar_runs),
                    "ratios": [g["tps"] / s["tps"] for g, s in zip(grammar_runs, shoal_runs, strict=True)],
                    "agent_cpu_ratios": [g["agent_cpu_ms_per_ktok"] / s["agent_cpu_ms_per_ktok"]
                                         for g, s in zip(grammar_runs, shoal_runs, strict=True)],
                }
        return shoal, direct, pairs, grammar
    finally:
        processes.stop_all()


@click.command("serve")
@click.option("--preset", default="small", show_default=True, help="Torch preset of the engine.")
@click.option("--concurrency", "concurrencies", type=int, multiple=True, default=(8, 32, 64),
              show_default=True, help="Concurrent streaming clients (repeatable).")
@click.option("--prompt-tokens", type=int, default=32, show_default=True)
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--threads", type=int, default=1, show_default=True, help="Torch threads (both sides).")
@click.option("--rounds", type=int, default=3, show_default=True,
              help="Alternating shoal/direct runs per concurrency; the median is reported.")
@click.option("--instances", type=int, default=1, show_default=True,
              help="Agents behind the frontend (and direct engines, one process each, to compare with).")
@click.option("--engine-core", type=click.Choice(["thread", "process"]), default="thread", show_default=True,
              help="The agents' --engine-core (the direct engine computes in its own process either way).")
@click.option("--grammar", is_flag=True,
              help="Also run every round with a json_schema response_format on every request (the built-in "
                   "schema, or --json-schema's): the grammar's throughput cost, paired with the plain run.")
@click.option("--json-schema", "schema_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="The JSON schema for --grammar (implies it).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_serve(preset: str, concurrencies: tuple[int, ...], prompt_tokens: int, max_tokens: int,
                threads: int, rounds: int, instances: int, engine_core: str, grammar: bool,
                schema_path: Path | None, json_path: Path | None) -> None:
    """Streaming tokens/s and TTFT through shoal (frontend + NATS + agent) vs the engine alone.

    The defaults take a few minutes on two cores; tighter medians: --rounds 5.
    """
    import torch

    schema: dict[str, Any] | None = None
    if schema_path is not None:
        loaded = json.loads(schema_path.read_text())
        if not isinstance(loaded, dict):
            raise click.BadParameter("a JSON schema is an object", param_hint="--json-schema")
        schema = loaded
    elif grammar:
        schema = BENCH_SCHEMA

    torch.set_num_threads(threads)
    levels = sorted(set(concurrencies), key=int)
    if instances < 1:
        raise click.BadParameter("must be >= 1", param_hint="--instances")
    with scratch_dir("shoal-bench-serve-") as log_dir:
        shoal, direct, pairs, constrained = run_through_shoal(
            preset, levels, prompt_tokens, max_tokens, threads, log_dir, rounds=rounds, instances=instances,
            engine_core=engine_core, schema=schema,
        )
    results: dict[str, Any] = {}
    machine = platform.processor() or platform.machine()
    click.echo(f"preset {preset}, prompt {prompt_tokens} tokens, {max_tokens} output tokens per request, "
               f"{instances} instance(s), engine core {engine_core}, torch threads {threads}, "
               f"{os.cpu_count()} CPUs, {machine}")
    click.echo(f"{'streams':>8} {'shoal tok/s':>12} {'direct tok/s':>13} {'ratio':>6} "
               f"{'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'direct p50':>11} {'direct p99':>11}")
    for c in levels:
        s, d = shoal[c], direct[c]
        ratio = s["tps"] / d["tps"] if d["tps"] else float("nan")
        results[str(c)] = {
            "shoal_tps": s["tps"], "direct_tps": d["tps"], "ratio": ratio,
            "ttft_p50_ms": s["ttft_p50_ms"], "ttft_p99_ms": s["ttft_p99_ms"],
            "direct_ttft_p50_ms": d["ttft_p50_ms"], "direct_ttft_p99_ms": d["ttft_p99_ms"],
            "shoal_tokens": s["tokens"], "direct_tokens": d["tokens"],
            "cpu_ms_per_1k_tokens": {
                name: s[f"{name}_cpu_ms_per_ktok"] for name in ("agent", "frontend", "nats", "clients")
            },
            "direct_cpu_ms_per_1k_tokens": d["cpu_ms_per_ktok"],
            "client_send_spread_ms": s["send_spread_ms"],
            "shoal_steps": s["steps"], "direct_steps": d["steps"],
            "shoal_step_s": s["step_s"], "direct_step_s": d["step_s"],
            "rounds": pairs[c],
            "median_of_paired_ratios": statistics.median(p["ratio"] for p in pairs[c]),
            "wall_breakdown": {key: statistics.median(p[key] for p in pairs[c]) for key in pairs[c][0]
                               if key not in ("ratio", "direct_first")},
        }
        shoal_cpu = sum(results[str(c)]["cpu_ms_per_1k_tokens"].values())
        # with every core busy (both sides), tokens/s go as 1 / CPU per token: shoal's ratio cannot pass this
        results[str(c)]["cpu_ceiling_ratio"] = d["cpu_ms_per_ktok"] / shoal_cpu if shoal_cpu else float("nan")
        click.echo(f"{c:>8} {s['tps']:>12.1f} {d['tps']:>13.1f} {ratio:>6.2f} {s['ttft_p50_ms']:>12.1f} "
                   f"{s['ttft_p99_ms']:>12.1f} {d['ttft_p50_ms']:>11.1f} {d['ttft_p99_ms']:>11.1f}")
    click.echo("client ramp (first to last request of the burst sent): "
               + ", ".join(f"{c}: {shoal[c]['send_spread_ms']:.1f} ms" for c in levels))
    click.echo("CPU ms per 1000 output tokens (direct engine | shoal: agent, frontend, nats, clients | "
               "ceiling: the ratio if every core is busy):")
    for c in levels:
        cpu = results[str(c)]["cpu_ms_per_1k_tokens"]
        click.echo(f"{c:>8} {results[str(c)]['direct_cpu_ms_per_1k_tokens']:>9.0f} | "
                   + ", ".join(f"{name} {value:.0f}" for name, value in cpu.items())
                   + f" | {results[str(c)]['cpu_ceiling_ratio']:.2f}")
    for line in breakdown_table({c: results[str(c)] for c in levels}):
        click.echo(line)
    if constrained:
        click.echo("json_schema response_format on every request (through shoal), beside the plain runs:")
        click.echo(f"{'streams':>8} {'plain tok/s':>12} {'schema tok/s':>13} {'ratio':>6} {'paired':>7} "
                   f"{'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'tokens':>7} {'agent CPU/tok':>14}")
        for c in levels:
            g, s = constrained[c]["median_run"], shoal[c]
            paired = statistics.median(constrained[c]["ratios"])
            results[str(c)]["json_schema"] = {
                "tps": g["tps"], "ratio": g["tps"] / s["tps"] if s["tps"] else float("nan"),
                "median_of_paired_ratios": paired, "paired_ratios": constrained[c]["ratios"],
                "agent_cpu_ms_per_1k_tokens": g["agent_cpu_ms_per_ktok"],
                "frontend_cpu_ms_per_1k_tokens": g["frontend_cpu_ms_per_ktok"],
                "agent_cpu_paired_ratios": constrained[c]["agent_cpu_ratios"],
                "median_of_agent_cpu_paired_ratios": statistics.median(constrained[c]["agent_cpu_ratios"]),
                "ttft_p50_ms": g["ttft_p50_ms"], "ttft_p99_ms": g["ttft_p99_ms"], "tokens": g["tokens"],
                "steps": g["steps"], "step_s": g["step_s"],
            }
            ratio = results[str(c)]["json_schema"]["ratio"]
            click.echo(f"{c:>8} {s['tps']:>12.1f} {g['tps']:>13.1f} {ratio:>6.2f} {paired:>7.2f} "
                       f"{g['ttft_p50_ms']:>12.1f} {g['ttft_p99_ms']:>12.1f} {g['tokens']:>7.0f} "
                       f"{statistics.median(constrained[c]['agent_cpu_ratios']):>13.2f}x")
    meta = {"preset": preset, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "threads": threads,
            "instances": instances, "engine_core": engine_core, "json_schema": schema,
            "rounds": rounds, "load_average": os.getloadavg(), "event_loop": event_loop.loop_name(),
            "cpus": os.cpu_count(), "median_ratio": statistics.median(r["ratio"] for r in results.values())}
    if json_path is not None:
        json_path.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        click.echo(f"wrote {json_path}")
