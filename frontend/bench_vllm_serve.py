"""``shoal bench vllm-serve``: shoal's serving overhead over vLLM alone, measured with vLLM's own client.

The same checkpoint is served twice, one server at a time (never both: they
would share the cores):

* **vllm**: ``vllm serve DIR`` (vLLM's OpenAI server, its engine core in a
  child process);
* **shoal**: ``shoal up --engine vllm --model DIR --instances 1`` (embedded
  NATS, scheduler, one agent with an in-process vLLM engine, the frontend);
* **shoal-torch** (with ``--servers vllm,shoal,shoal-torch``): ``shoal up
  --engine torch --model DIR --instances 1``, shoal's built-in engine on the
  same checkpoint (one torch thread, as vLLM's CPU worker gets one core here);
  **shoal-torch-bf16** the same in bfloat16 (``--dtype bfloat16``; shoal-torch
  runs in the comparison's ``--dtype``, with ``auto`` the engine's float32 on CPU);
* **shoal-nobind** (``--with-nobind``, or in ``--servers``): ``shoal`` with
  ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (the agent's model thread neither pinned
  nor limited to one OpenMP thread per CPU: what binding brings, side by side).

Against each, for every ``--concurrency``, ``vllm bench serve --backend openai
--dataset-name random --random-input-len 256 --random-output-len 128
--ignore-eos --max-concurrency C --num-prompts N --save-result`` runs (through
:mod:`agents.engines.vllm_engine.vllm_cli`, vLLM's command line on the
``vllm-cpu`` distribution too), and its saved JSON is read back (16 prompts at
concurrency 8 in one round by default; ``--concurrency 8,32`` and ``--dtype
float32,bfloat16`` sweep). Both servers
get the engine options shoal's vllm engine uses: block size, context length,
dtype, KV space (1 GiB by default), eager mode, and prefix caching on, as both ship
(random prompts share no prefix, so it costs each side only its lookups). With
``--rounds`` > 1 the servers alternate and each figure is the median over
rounds. Reported per concurrency and shoal server: output tokens/s of each and
shoal's share of vLLM's (``ratio``), median TTFT and TPOT of each, the load average around each run
(the machine may be shared), and the CPU each server's components spend per request over the
load (:mod:`frontend.bench_path_cpu`: shoal's frontend, scheduler, agent loop and nats-server
beside ``vllm serve``'s API server, and the bus messages per request and per token); with
``--non-streamed`` the same for the load sent without streaming. Every child runs in its own
process group, dies with this process and is stopped (SIGINT, then SIGKILL) when a run ends or
the benchmark is interrupted.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import click

from bus import event_loop
from bus.bench_progress import BenchProgress
from bus.server import die_with_parent, free_port
from frontend.bench_cli import scratch_dir
from frontend.bench_path_cpu import (
    PathMeter,
    Sampler,
    cpu_table,
    drive_whole,
    load_window,
    path_ratios,
    per_request,
    prompt_vocabulary,
)
from frontend.up import _health

__all__ = [
    "NotRunnable",
    "Server",
    "bench_vllm_serve",
    "client_command",
    "paired_ratios",
    "parse_result",
    "server_command",
    "summarize",
]

_SHOAL = [sys.executable, "-c", "from frontend.cli import main; main()"]
#: the servers this benchmark knows; ``vllm`` is the baseline every other one is compared with
SERVERS = ("vllm", "shoal", "shoal-torch", "shoal-torch-bf16", "shoal-nobind")
_VLLM = [sys.executable, "-m", "agents.engines.vllm_engine.vllm_cli"]
#: what each run's saved JSON is reduced to (``vllm bench serve``'s key -> ours)
_METRICS = {
    "output_throughput": "output_tps",
    "median_ttft_ms": "ttft_p50_ms",
    "median_tpot_ms": "tpot_p50_ms",
    "p99_ttft_ms": "ttft_p99_ms",
    "p99_tpot_ms": "tpot_p99_ms",
    "median_itl_ms": "itl_p50_ms",
    "request_throughput": "requests_per_s",
    "completed": "completed",
    "total_output_tokens": "output_tokens",
    "duration": "duration_s",
}


@dataclass(frozen=True)
class EngineOptions:
    """What both servers are told about the engine."""

    model: Path
    max_model_len: int
    block_size: int
    kv_cache_bytes: int
    dtype: str


def server_command(kind: str, options: EngineOptions, port: int, log_dir: Path) -> list[str]:
    """One server's command line: ``vllm`` (``vllm serve``), ``shoal`` or ``shoal-torch`` (``shoal up``)."""
    if kind == "vllm":
        return [
            *_VLLM, "serve", str(options.model), "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(options.max_model_len), "--block-size", str(options.block_size),
            "--kv-cache-memory-bytes", str(options.kv_cache_bytes), "--dtype", options.dtype,
            "--enforce-eager", "--disable-log-stats",
        ]  # fmt: skip
    if kind in ("shoal", "shoal-nobind"):
        return [
            *_SHOAL, "up", "--engine", "vllm", "--model", str(options.model), "--instances", "1",
            "--port", str(port), "--max-model-len", str(options.max_model_len),
            "--block-size", str(options.block_size), "--kv-cache-bytes", str(options.kv_cache_bytes),
            "--dtype", options.dtype, "--log-dir", str(log_dir / f"{kind}-up"), "--ready-timeout", "600",
        ]  # fmt: skip
    if kind in ("shoal-torch", "shoal-torch-bf16"):  # the built-in engine: its KV default (256 MiB) suffices
        # the comparison's dtype (auto: the engine's float32 on CPU); shoal-torch-bf16 always bfloat16
        dtype = "bfloat16" if kind == "shoal-torch-bf16" else options.dtype
        return [
            *_SHOAL, "up", "--engine", "torch", "--model", str(options.model), "--instances", "1",
            "--threads", "1", "--port", str(port), "--log-dir", str(log_dir / f"{kind}-up"),
            "--ready-timeout", "600", *(["--dtype", dtype] if dtype != "auto" else []),
        ]  # fmt: skip
    raise ValueError(f"unknown server {kind!r}")


def parse_servers(text: str) -> tuple[str, ...]:
    """``--servers``: known names, vllm (the baseline) among them, no repeats."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in SERVERS]
    if unknown:
        known = ", ".join(SERVERS)
        raise click.BadParameter(f"unknown {unknown}; choose from {known}", param_hint="--servers")
    if "vllm" not in names or len(names) < 2 or len(set(names)) != len(names):
        raise click.BadParameter("list vllm and at least one shoal server, each once", param_hint="--servers")
    return names


def client_command(
    url: str, options: EngineOptions, *, concurrency: int, num_prompts: int, input_len: int, output_len: int,
    result_dir: Path, result_name: str, seed: int, ignore_eos: bool = True,
) -> list[str]:  # fmt: skip
    """``vllm bench serve`` against ``url``, saving its result as ``result_dir/result_name``."""
    return [
        *_VLLM, "bench", "serve", "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", str(options.model), "--tokenizer", str(options.model),
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), *(["--ignore-eos"] if ignore_eos else []),
        "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency), "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", result_name,
    ]  # fmt: skip


def parse_result(path: Path) -> dict[str, float]:
    """The figures this benchmark reports, from a ``vllm bench serve --save-result`` JSON file."""
    data = json.loads(path.read_text())
    missing = [key for key in _METRICS if key not in data]
    if missing:
        raise click.ClickException(f"{path}: vllm bench serve's result lacks {missing}")
    return {ours: float(data[theirs]) for theirs, ours in _METRICS.items()}


def summarize(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per figure (those every round has), the median over rounds."""
    keys = [key for key in runs[0] if all(key in run for run in runs)]
    return {key: statistics.median(run[key] for run in runs) for key in keys}


#: the figures compared round by round: (our key, the figure's key)
_PAIRED = (("tps", "output_tps"), ("ttft_p50", "ttft_p50_ms"), ("tpot_p50", "tpot_p50_ms"))


def paired_ratios(server: Sequence[dict[str, float]], vllm: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Each round's figure of ``server`` over vLLM's in the same round, and the median of those ratios.

    Rounds a few minutes apart see a machine of another speed (a shared machine's
    neighbours, its clock), and the servers of one round run back to back, so the
    ratio within a round is the figure to take the median of; the ratio of two
    medians can pair a fast round of one server with a slow round of the other.
    """
    if len(server) != len(vllm):
        raise ValueError(f"{len(server)} rounds of the server against {len(vllm)} of vllm")
    paired: dict[str, Any] = {}
    for name, key in _PAIRED:
        ratios = [s[key] / v[key] if v[key] else float("nan") for s, v in zip(server, vllm, strict=True)]
        paired[f"{name}_ratios"] = ratios
        paired[f"median_{name}_ratio"] = statistics.median(ratios)
    return paired


class NotRunnable(click.ClickException):
    """A server died of an illegal instruction (vLLM's bfloat16 kernels on a CPU or kernel that
    refuses them): the comparison in that dtype cannot run on this machine."""


#: how the servers report a process ended by SIGILL: shoal up's supervisor by the signal's name,
#: vLLM by the exit code of its worker or engine core (-4)
_SIGILL = re.compile(r"SIGILL|illegal instruction|exit code:? -4\b|': -4\}", re.IGNORECASE)


@dataclass
class Server:
    """One server in its own process group (dying with this process), logging to a file."""

    kind: str
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path
    startup_s: float = 0.0

    @classmethod
    def start(cls, kind: str, options: EngineOptions, log_dir: Path) -> Server:
        port = free_port()
        log_path = log_dir / f"{kind}-{port}.log"
        log: IO[bytes] = open(log_path, "ab")
        try:
            env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"} if kind == "shoal-nobind" else None
            process = subprocess.Popen(
                server_command(kind, options, port, log_dir), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent, env=env,
            )  # fmt: skip
        finally:
            log.close()
        return cls(kind, process, f"http://127.0.0.1:{port}", log_path)

    def ready(self) -> bool:
        if self.kind.startswith("shoal"):  # the frontend answers before the agent has joined
            health = _health(self.url)
            return bool(health and health.get("instances"))
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as response:
                return bool(response.status == 200)
        except Exception:
            return False

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until ready; a ClickException (with the log's tail) if it died or took too long."""
        started = time.monotonic()
        while not self.ready():
            if self.process.poll() is not None or time.monotonic() - started > timeout_s:
                self.raise_if_not_runnable()
                tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:])
                raise click.ClickException(f"{self.kind} server did not start ({self.log_path}):\n{tail}")
            time.sleep(0.5)
        self.startup_s = time.monotonic() - started
        return self.startup_s

    def raise_if_not_runnable(self) -> None:
        """:class:`NotRunnable` if the server (or a process of it) died of an illegal instruction."""
        if self.process.poll() == -signal.SIGILL:
            raise NotRunnable(f"{self.kind}: SIGILL (exit {self.process.returncode}); log {self.log_path}")
        folders = [self.log_path.parent / f"{self.kind}-up"]  # shoal up's children log there
        for path in [self.log_path, *(p for f in folders if f.is_dir() for p in sorted(f.glob("*.log")))]:
            text = path.read_text(errors="replace")
            match = _SIGILL.search(text)
            if match:
                line = text[text.rfind("\n", 0, match.start()) + 1 : text.find("\n", match.end())]
                raise NotRunnable(f"{self.kind}: {line.strip()[:300]} ({path})")

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGINT to the group (both servers shut down their children on it), SIGKILL after ``grace_s``."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # anything left in its group
        self.process.wait()


@contextlib.contextmanager
def _serving(kind: str, options: EngineOptions, log_dir: Path, ready_timeout_s: float) -> Iterator[Server]:
    server = Server.start(kind, options, log_dir)
    try:
        startup = server.wait_ready(ready_timeout_s)
        click.echo(f"{kind:>12} server ready in {startup:.0f} s ({server.url})")
        yield server
    finally:
        server.stop()


def run_client(command: list[str], log_path: Path, timeout_s: float) -> None:
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip
        try:
            status = process.wait(timeout_s)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
    if status != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise click.ClickException(f"vllm bench serve failed ({log_path}):\n{tail}")


def _int_list(values: tuple[str, ...], name: str) -> tuple[int, ...]:
    """Repeatable and comma-separated (``8,32``) positive integers."""
    try:
        found = tuple(int(item) for value in values for item in value.split(",") if item.strip())
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint=name) from error
    if not found or any(value < 1 for value in found):
        raise click.BadParameter("positive integers, comma-separated or repeated", param_hint=name)
    return found


@click.command("vllm-serve")
@click.option(
    "--model",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Checkpoint folder (default: vllm_engine.checkpoint's small random float32 Llama, built here).",
)
@click.option(
    "--concurrency",
    "concurrencies",
    multiple=True,
    default=("8",),
    show_default=True,
    help="vllm bench serve --max-concurrency: repeatable or comma-separated (8,32).",
)
@click.option("--num-prompts", type=int, default=16, show_default=True, help="Prompts per client run.")
@click.option("--input-len", "--random-input-len", "input_len", type=int, default=256, show_default=True)
@click.option("--output-len", "--random-output-len", "output_len", type=int, default=128, show_default=True)
@click.option(
    "--ignore-eos/--no-ignore-eos",
    default=True,
    show_default=True,
    help="Every request generates --output-len tokens (vllm bench serve --ignore-eos).",
)
@click.option("--max-model-len", type=int, default=1024, show_default=True)
@click.option("--block-size", type=int, default=32, show_default=True)
@click.option("--kv-cache-bytes", type=int, default=2**30, show_default=True, help="KV space of each server.")
@click.option(
    "--dtype",
    "dtypes",
    default="auto",
    show_default=True,
    help="Comma-separated (float32,bfloat16): the whole comparison once per dtype; a dtype a server "
    "dies on with an illegal instruction is reported as not runnable here.",
)
@click.option(
    "--rounds",
    type=int,
    default=1,
    show_default=True,
    help="Alternating servers per figure; medians of paired ratios over rounds are reported.",
)
@click.option(
    "--servers",
    default="vllm,shoal",
    show_default=True,
    help=f"Comma-separated, from {', '.join(SERVERS)}; vllm is the baseline of every ratio.",
)
@click.option(
    "--non-streamed",
    is_flag=True,
    help="After each streamed client run, the same load non-streamed (this benchmark's own aiohttp "
    "client, random token-id prompts): its CPU per request too.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--ready-timeout", type=float, default=600.0, show_default=True, help="Per server start, s.")
@click.option("--client-timeout", type=float, default=1800.0, show_default=True, help="Per client run, s.")
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep server and client logs and raw results here (default: a temporary folder, removed).",
)
@click.option(
    "--with-nobind",
    is_flag=True,
    help="Also run shoal with VLLM_CPU_OMP_THREADS_BIND=nobind (its model thread unpinned) each round.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_vllm_serve(
    model: Path | None, concurrencies: tuple[str, ...], num_prompts: int, input_len: int, output_len: int,
    ignore_eos: bool, max_model_len: int, block_size: int, kv_cache_bytes: int, dtypes: str, rounds: int,
    servers: str, non_streamed: bool, seed: int, ready_timeout: float,
    client_timeout: float, log_dir: Path | None, with_nobind: bool, json_path: Path | None,
) -> None:  # fmt: skip
    """Output tokens/s, TTFT, TPOT and the serving path's CPU per request: shoal up vs vllm serve.

    The defaults (16 prompts, one concurrency, one round) take a few minutes on two cores, most
    of it the servers' start-up. The comparison of vLLM's client against vLLM's server on a tiny
    float32 Llama, both dtypes, with the torch engine:

    shoal bench vllm-serve --servers vllm,shoal,shoal-torch --random-input-len 256
    --random-output-len 128 --num-prompts 200 --concurrency 8,32 --ignore-eos
    --dtype float32,bfloat16 --max-model-len 2048 --block-size 32 --rounds 4 --non-streamed
    """
    from agents.engines.vllm_engine import vllm_unavailable_reason

    reason = vllm_unavailable_reason()
    if reason is not None:
        raise click.ClickException(reason)
    levels = _int_list(concurrencies, "--concurrency")
    if rounds < 1 or num_prompts < 1:
        raise click.UsageError("--rounds and --num-prompts must be positive")
    if input_len + output_len > max_model_len:
        raise click.UsageError("--input-len + --output-len must fit in --max-model-len")
    dtype_list = tuple(d.strip() for d in dtypes.split(",") if d.strip())
    if not dtype_list or len(set(dtype_list)) != len(dtype_list):
        raise click.BadParameter("one or more dtypes, each once", param_hint="--dtype")
    kinds = parse_servers(servers)
    if with_nobind and "shoal-nobind" not in kinds:
        kinds = (*kinds, "shoal-nobind")
    with contextlib.ExitStack() as stack:
        if log_dir is None:  # removed at the end, kept (and named) if the benchmark fails
            log_dir = stack.enter_context(scratch_dir("shoal-bench-vllm-serve-"))
        plan = Plan(
            levels=tuple(sorted(set(levels))), num_prompts=num_prompts, input_len=input_len,
            output_len=output_len, ignore_eos=ignore_eos, rounds=rounds, kinds=kinds, seed=seed,
            ready_timeout=ready_timeout, client_timeout=client_timeout, non_streamed=non_streamed,
        )  # fmt: skip
        log_dir.mkdir(parents=True, exist_ok=True)
        if model is None:
            from agents.engines.vllm_engine.checkpoint import build_checkpoint

            model = build_checkpoint(log_dir / "checkpoint")
        by_dtype: dict[str, Any] = {}
        for dtype in dtype_list:
            options = EngineOptions(model.resolve(), max_model_len, block_size, kv_cache_bytes, dtype)
            try:
                by_dtype[dtype] = _measure(log_dir / f"dtype-{dtype}", options, plan)
            except NotRunnable as error:
                click.echo(f"\ndtype {dtype}: not runnable on this machine: {error.message}")
                by_dtype[dtype] = {"not_runnable": error.message}
        if json_path is not None:
            from agents.engines.vllm_engine import vllm_version

            meta = {
                "model": str(model.resolve()), "num_prompts": num_prompts, "input_len": input_len,
                "output_len": output_len, "ignore_eos": ignore_eos, "max_model_len": max_model_len,
                "block_size": block_size, "kv_cache_bytes": kv_cache_bytes, "dtypes": dtype_list,
                "rounds": rounds, "seed": seed, "servers": kinds, "concurrency": plan.levels,
                "non_streamed": non_streamed, "vllm_version": vllm_version(),
                "cpus": os.cpu_count(), "load_average_end": os.getloadavg(),
            }  # fmt: skip
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps({"meta": meta, "by_dtype": by_dtype}, indent=2))
            click.echo(f"wrote {json_path}")


@dataclass(frozen=True)
class Plan:
    """What every server of every round is put through."""

    levels: tuple[int, ...]
    num_prompts: int
    input_len: int
    output_len: int
    ignore_eos: bool
    rounds: int
    kinds: tuple[str, ...]
    seed: int
    ready_timeout: float
    client_timeout: float
    non_streamed: bool


def _measured_run(server: Server, plan: Plan, options: EngineOptions, log_dir: Path, concurrency: int,
                  round_index: int) -> dict[str, float]:  # fmt: skip
    """One ``vllm bench serve`` run against ``server`` (and the non-streamed one): its figures and the
    CPU per request of each of the server's components over the load's own window."""
    meter = PathMeter.attach(server.kind, server.process.pid)
    name = f"{server.kind}-c{concurrency}-r{round_index}.json"
    load_before = os.getloadavg()[0]
    try:
        with Sampler(meter) as sampler:
            run_client(
                client_command(server.url, options, concurrency=concurrency, num_prompts=plan.num_prompts,
                               input_len=plan.input_len, output_len=plan.output_len, result_dir=log_dir,
                               result_name=name, seed=plan.seed + round_index, ignore_eos=plan.ignore_eos),
                log_dir / f"client-{server.kind}.log", plan.client_timeout,
            )  # fmt: skip
    except click.ClickException:
        server.raise_if_not_runnable()
        raise
    result = parse_result(log_dir / name)
    result["load_before"], result["load_after"] = load_before, os.getloadavg()[0]
    start, end = load_window(json.loads((log_dir / name).read_text()))
    result.update(
        per_request(sampler.between(start, end), int(result["completed"]), int(result["output_tokens"]))
    )
    if plan.non_streamed:
        vocab = prompt_vocabulary(options.model)
        with Sampler(meter) as sampler:
            whole = event_loop.run(drive_whole(
                server.url, str(options.model), concurrency=concurrency, num_prompts=plan.num_prompts,
                input_len=plan.input_len, output_len=plan.output_len, vocab=vocab,
                seed=plan.seed + round_index, ignore_eos=plan.ignore_eos,
            ))  # fmt: skip
        delta = sampler.between(whole.pop("started"), whole.pop("ended"))
        result.update({f"whole_{key}": value for key, value in whole.items()})
        result.update(per_request(delta, int(whole["completed"]), int(whole["output_tokens"]), "whole_"))
    return result


def _measure(log_dir: Path, options: EngineOptions, plan: Plan) -> dict[str, Any]:
    """Every round of every server in one dtype: the figures, medians and paired ratios."""
    from agents.engines.vllm_engine import vllm_version

    log_dir.mkdir(parents=True, exist_ok=True)
    kinds, levels, rounds = plan.kinds, plan.levels, plan.rounds
    click.echo(
        f"model {options.model}, dtype {options.dtype}, {plan.num_prompts} prompts of {plan.input_len} "
        f"random tokens, {plan.output_len} output tokens{' (ignore_eos)' if plan.ignore_eos else ''}, "
        f"vLLM {vllm_version()}, {os.cpu_count()} CPUs; working folder {log_dir}"
    )
    runs: dict[str, dict[int, list[dict[str, float]]]] = {kind: {} for kind in kinds}
    startup: dict[str, list[float]] = {kind: [] for kind in kinds}
    progress = BenchProgress("vllm-serve", rounds * len(kinds) * (1 + len(levels)))
    for round_index in range(rounds):
        shift = round_index % len(kinds)  # each server goes first in turn
        for kind in kinds[shift:] + kinds[:shift]:
            progress.phase(f"round {round_index + 1}/{rounds}: starting {kind} ({options.dtype})")
            with _serving(kind, options, log_dir, plan.ready_timeout) as server:
                startup[kind].append(server.startup_s)
                for concurrency in levels:
                    progress.phase(
                        f"round {round_index + 1}/{rounds}: vllm bench serve against {kind}, "
                        f"{plan.num_prompts} prompts, concurrency {concurrency}"
                    )
                    result = _measured_run(server, plan, options, log_dir, concurrency, round_index)
                    runs[kind].setdefault(concurrency, []).append(result)
                    path = result.get("cpu_path_ms", result.get("cpu_api_server_ms", float("nan")))
                    click.echo(
                        f"{kind:>11} c={concurrency:<3} {result['output_tps']:8.1f} tok/s  TTFT p50 "
                        f"{result['ttft_p50_ms']:7.1f} ms  TPOT p50 {result['tpot_p50_ms']:6.1f} ms  "
                        f"path CPU {path:5.2f} ms/req  "
                        f"load {result['load_before']:.1f}->{result['load_after']:.1f}"
                    )
    results = report(runs, kinds, levels, rounds, non_streamed=plan.non_streamed)
    commands = {
        **{kind: (["VLLM_CPU_OMP_THREADS_BIND=nobind"] if kind == "shoal-nobind" else [])
           + server_command(kind, options, 0, log_dir) for kind in kinds},
        "client": client_command("URL", options, concurrency=0, num_prompts=plan.num_prompts,
                                 input_len=plan.input_len, output_len=plan.output_len, result_dir=log_dir,
                                 result_name="R", seed=plan.seed, ignore_eos=plan.ignore_eos),
    }  # fmt: skip
    return {"results": results, "runs": runs, "startup_s": startup, "commands": commands}


def report(
    runs: dict[str, dict[int, list[dict[str, float]]]], kinds: tuple[str, ...], levels: tuple[int, ...],
    rounds: int, *, non_streamed: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Print the tables (throughput and latency, paired ratios, CPU per request); the results by
    concurrency."""
    results: dict[str, Any] = {}
    click.echo(
        f"\n{'conc':>5} {'server':>11} {'vllm tok/s':>11} {'tok/s':>9} {'ratio':>6} {'TTFT p50 vllm':>14} "
        f"{'server':>7} {'TPOT p50 vllm':>14} {'server':>7} {'load':>10}"
    )
    for concurrency in levels:
        v = summarize(runs["vllm"][concurrency])
        results[str(concurrency)] = {"vllm": v}
        for kind in (k for k in kinds if k != "vllm"):
            s = summarize(runs[kind][concurrency])
            ratio = s["output_tps"] / v["output_tps"] if v["output_tps"] else float("nan")
            results[str(concurrency)][kind] = s
            results[str(concurrency)][f"ratio_{kind}" if kind != "shoal" else "ratio"] = ratio
            results[str(concurrency)][f"paired_{kind}"] = paired_ratios(
                runs[kind][concurrency], runs["vllm"][concurrency]
            )
            low, high = min(v["load_before"], s["load_before"]), max(v["load_after"], s["load_after"])
            load = f"{low:.1f}-{high:.1f}"
            click.echo(
                f"{concurrency:>5} {kind:>11} {v['output_tps']:>11.1f} {s['output_tps']:>9.1f} {ratio:>6.2f} "
                f"{v['ttft_p50_ms']:>11.1f} ms {s['ttft_p50_ms']:>7.1f} {v['tpot_p50_ms']:>11.1f} ms "
                f"{s['tpot_p50_ms']:>7.1f} {load:>10}"
            )
    click.echo(f"\neach round's figure over vllm's in that round: median (range) of {rounds} round(s)")
    click.echo(f"{'conc':>5} {'server':>11} {'tok/s':>20} {'TTFT p50':>20} {'TPOT p50':>20}")
    for concurrency in levels:
        for kind in (k for k in kinds if k != "vllm"):
            paired = results[str(concurrency)][f"paired_{kind}"]
            cells = [
                f"{paired[f'median_{name}_ratio']:.2f} ({min(paired[f'{name}_ratios']):.2f}-"
                f"{max(paired[f'{name}_ratios']):.2f})"
                for name, _ in _PAIRED
            ]
            click.echo(f"{concurrency:>5} {kind:>11} " + " ".join(f"{cell:>20}" for cell in cells))
    for prefix, title in (("", "streamed (vllm bench serve)"), ("whole_", "non-streamed (own client)")):
        if prefix and not non_streamed:
            continue
        click.echo(cpu_table(runs, kinds, levels, prefix, title))
        for concurrency in levels:
            for kind in (k for k in kinds if k != "vllm"):
                ratios = path_ratios(runs[kind][concurrency], runs["vllm"][concurrency], prefix)
                if ratios:
                    results[str(concurrency)][f"{prefix}path_over_api_server_{kind}"] = {
                        "ratios": ratios, "median": statistics.median(ratios),
                    }  # fmt: skip
    return results
