"""``shoal bench path-cpu``: the serving path's CPU per request per process, on a ``sim`` cluster.

One cluster per variant (``--variant NAME=SOURCE_TREE``, each run from its own source tree by
``PYTHONPATH``; none given: this tree): an embedded nats-server with its monitoring port,
``shoal scheduler`` (unless ``--no-scheduler``), one ``shoal agent --engine sim`` whose profile
has the small random Llama checkpoint's vocabulary (the engine costs only its modeled step) and
``shoal serve`` with that checkpoint's tokenizer. Every round sends each cluster in turn (the
order alternates) the same load: ``--requests`` completions of ``--prompt-tokens`` prompt tokens
(a text prompt, or token ids with ``--token-ids``) and ``--max-tokens`` output tokens
(``ignore_eos``), ``--concurrency`` at a time, streamed and, with ``--whole``, not streamed.

Per run: each process's CPU (user + system from ``/proc``: :mod:`frontend.bench_path_cpu`) and
the messages nats-server took in and sent out (``/varz``) from just before the load to shortly
after it (the last requests' events delivered), per request; with ``--subjects`` also the
messages per subject pattern, counted by a subscriber to ``>`` (its deliveries are taken off the
messages sent out; its load stays in nats-server's CPU). The arithmetic and the table are in
:mod:`frontend.bench_path_report`. Not a test: the figures depend on the machine and its load.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import click

from bus.server import EmbeddedNats, die_with_parent, free_port
from frontend.bench_cli import scratch_dir
from frontend.bench_path_cpu import gains, read_cpu, read_varz
from frontend.bench_path_report import (
    Variant,
    parse_variants,
    progress_line,
    rotation,
    run_figures,
    subject_pattern,
    subjects_table,
    summarize,
    table,
)
from frontend.up import _health

__all__ = ["LoadOptions", "SimCluster", "bench_path_cpu", "start_cluster"]

_SHOAL_CODE = "from frontend.cli import main; main()"
#: after the load, until the last requests' events are appended and delivered
_SETTLE_S = 0.3
#: the small random checkpoint's vocabulary (ids below 3 are its special tokens)
_VOCAB = 512
_FIRST_ID = 3


@dataclass(frozen=True)
class LoadOptions:
    """The load every cluster gets, and how it is counted."""

    requests: int
    prompt_tokens: int
    max_tokens: int
    concurrency: int
    token_ids: bool
    subjects: bool
    client_timeout_s: float


@dataclass
class SimCluster:
    """One variant's running cluster: its processes by role and where to read them."""

    name: str
    tree: Path
    log_dir: Path
    nats: EmbeddedNats
    varz: str
    url: str = ""
    groups: dict[str, list[int]] = field(default_factory=dict)
    children: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def spawn(self, role: str, argv: Sequence[str]) -> None:
        """``shoal ARGV`` from this variant's tree: ``-c`` puts the working folder first on the
        path, so the child runs in the log folder, not in a source tree."""
        with open(self.log_dir / f"{role}.log", "ab") as log:
            child = subprocess.Popen(
                [sys.executable, "-c", _SHOAL_CODE, *argv],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.log_dir,
                env={**os.environ, "PYTHONPATH": str(self.tree)}, start_new_session=True,
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )  # fmt: skip
        self.children[role] = child
        self.groups[role] = [child.pid]

    def check_alive(self) -> None:
        for role, child in self.children.items():
            if child.poll() is not None:
                raise click.ClickException(
                    f"{self.name}: {role} exited with code {child.returncode}; log {self.log_dir / role}.log"
                )
        if not self.nats.running:
            raise click.ClickException(f"{self.name}: nats-server exited; log {self.log_dir / 'nats.log'}")

    def read(self) -> dict[str, float]:
        """Cumulative CPU seconds by process (the agent's whole process, its sim step included)
        and the nats-server's message counters."""
        reading = read_cpu(self.groups)
        reading["agent"] = reading.pop("agent_loop", 0.0) + reading.pop("model", 0.0)
        reading.update(read_varz(self.varz))
        return reading

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGINT to every child's group (a stop, not an agent's SIGTERM drain), SIGKILL after
        ``grace_s``; then the nats-server."""
        for child in self.children.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGINT)
        deadline = time.monotonic() + grace_s
        for child in self.children.values():
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait(5.0)
        self.nats.stop()


def start_cluster(
    variant: Variant, log_dir: Path, *, checkpoint: Path, profile: Path, time_scale: float, scheduler: bool
) -> SimCluster:
    """Start one variant's cluster (see the module's text); ready once :func:`wait_ready` says so."""
    name, tree = variant
    log_dir.mkdir(parents=True, exist_ok=True)
    monitor = free_port()
    nats = EmbeddedNats(
        store_dir=log_dir / "nats-store",
        log_file=log_dir / "nats.log",
        monitor_port=monitor,
        die_with_parent=True,
    ).start()
    cluster = SimCluster(name, tree, log_dir, nats, f"http://127.0.0.1:{monitor}/varz")
    cluster.groups["nats"] = [nats.pid or 0]
    quiet = ["--log-level", "WARNING"]
    if scheduler:
        cluster.spawn("scheduler", ["scheduler", "--nats", nats.url, *quiet])
    cluster.spawn("agent", [
        "agent", "--nats", nats.url, "--instance-id", "a0", "--engine", "sim", "--profile", str(profile),
        "--time-scale", str(time_scale), "--transport", "tcp", *quiet,
    ])  # fmt: skip
    port = free_port()
    # without a scheduler a dispatch has no responders: the frontend places after a short wait
    dispatch = [] if scheduler else ["--dispatch-timeout", "0.2"]
    cluster.spawn("frontend", [
        "serve", "--nats", nats.url, "--model", str(checkpoint), "--port", str(port),
        "--max-model-len", "2048", *dispatch,
    ])  # fmt: skip
    cluster.url = f"http://127.0.0.1:{port}"
    return cluster


def wait_ready(clusters: Sequence[SimCluster], timeout_s: float) -> None:
    """Until every cluster's frontend lists its agent; ClickException if a process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    for cluster in clusters:
        while not ((health := _health(cluster.url)) and health.get("instances")):
            cluster.check_alive()
            if time.monotonic() > deadline:
                raise click.ClickException(
                    f"{cluster.name}: the frontend saw no ready agent within {timeout_s:.0f} s; "
                    f"logs in {cluster.log_dir}"
                )
            time.sleep(0.3)


def sim_inputs(folder: Path, profile_name: str) -> tuple[Path, Path]:
    """The checkpoint (its tokenizer for the frontends) and a sim profile with its vocabulary."""
    import msgspec

    from agents.engines.profile import dump_profile, load_profile
    from agents.engines.vllm_engine.checkpoint import build_checkpoint

    checkpoint = Path(build_checkpoint(folder / "checkpoint"))
    profile = msgspec.structs.replace(
        load_profile(profile_name), name="path-cpu", vocab_size=_VOCAB, eos_token_id=1, num_blocks=8192,
        max_model_len=2048,
    )  # fmt: skip
    path = folder / "profile.json"
    dump_profile(profile, path)
    return checkpoint, path


def build_prompts(checkpoint: Path, options: LoadOptions) -> list[str | list[int]]:
    """``requests`` prompts of random token ids (seeded), as ids of the checkpoint's tokenizer or as
    the text of ids of its model's vocabulary (the frontend tokenizes it again, as a client's text)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    top = min(_VOCAB, tokenizer.get_vocab_size()) if options.token_ids else _VOCAB
    chooser = random.Random(0)
    ids = [
        [chooser.randrange(_FIRST_ID, top) for _ in range(options.prompt_tokens)]
        for _ in range(options.requests)
    ]
    if options.token_ids:
        return list(ids)
    return [tokenizer.decode(prompt) for prompt in ids]


async def drive(
    url: str, model: str, prompts: Sequence[str | list[int]], *, concurrency: int, max_tokens: int,
    stream: bool, timeout_s: float,
) -> dict[str, float]:  # fmt: skip
    """Every prompt as one ``/v1/completions`` request, ``concurrency`` at a time (aiohttp): the wall
    time and, streamed, the median time to the first chunk."""
    queue = collections.deque(prompts)
    firsts: list[float] = []

    async def one(client: aiohttp.ClientSession, prompt: str | list[int]) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}  # fmt: skip
        started = time.perf_counter()
        async with client.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                raise click.ClickException(
                    f"HTTP {response.status} from {url}: {(await response.text())[:300]}"
                )
            first = True
            async for _ in response.content.iter_any():
                if first and stream:
                    firsts.append(time.perf_counter() - started)
                first = False

    async def worker(client: aiohttp.ClientSession) -> None:
        while queue:
            await one(client, queue.popleft())

    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        figures = {"wall_s": time.perf_counter() - started}
    if firsts:
        figures["ttft_p50_ms"] = 1000.0 * statistics.median(firsts)
    return figures


class SubjectCounter:
    """A subscriber to ``>`` on one nats-server counting messages by :func:`subject_pattern` while on."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.on = False
        self._connection: Any = None

    async def start(self, nats_url: str) -> None:
        import nats

        self._connection = await nats.connect(nats_url, name="path-cpu-subject-counter")

        async def count(msg: Any) -> None:
            if self.on:
                self.counts[subject_pattern(msg.subject)] += 1

        await self._connection.subscribe(">", cb=count)
        await self._connection.flush()

    async def stop(self) -> None:
        if self._connection is not None:
            await self._connection.drain()


async def _measured(
    cluster: SimCluster, model: str, prompts: Sequence[str | list[int]], options: LoadOptions, stream: bool
) -> tuple[dict[str, float], dict[str, float]]:
    counter = SubjectCounter()
    if options.subjects:
        await counter.start(cluster.nats.url)
    try:
        counter.on = True
        before = cluster.read()
        timing = await drive(
            cluster.url, model, prompts, concurrency=options.concurrency, max_tokens=options.max_tokens,
            stream=stream, timeout_s=options.client_timeout_s,
        )  # fmt: skip
        await asyncio.sleep(_SETTLE_S)
        after = cluster.read()
        counter.on = False
    finally:
        await counter.stop()
    delta = gains(before, after)
    counted = sum(counter.counts.values())
    delta["bus_out_msgs"] = max(0.0, delta.get("bus_out_msgs", 0.0) - counted)  # the counter's own deliveries
    figures = run_figures(
        delta, requests=options.requests, output_tokens=options.requests * options.max_tokens
    )
    figures.update(timing)
    subjects = {key: value / options.requests for key, value in counter.counts.most_common()}
    return figures, subjects


def measure(
    cluster: SimCluster, model: str, prompts: Sequence[str | list[int]], options: LoadOptions, stream: bool
) -> tuple[dict[str, float], dict[str, float]]:
    """One run of the load against ``cluster``: its figures (:func:`frontend.bench_path_report.run_figures`,
    the wall time and the streamed TTFT) and, with ``--subjects``, messages per request by subject."""
    cluster.check_alive()
    try:
        return asyncio.run(_measured(cluster, model, prompts, options, stream))
    # a process gone (its counters unreadable or gone back), a connection refused or cut, a timeout
    except (OSError, ValueError, TimeoutError, aiohttp.ClientError) as error:
        cluster.check_alive()
        raise click.ClickException(
            f"{cluster.name}: the run failed: {error!r}; logs in {cluster.log_dir}"
        ) from error


Rows = dict[str, dict[str, list[dict[str, float]]]]


def run_rounds(
    clusters: dict[str, SimCluster], model: str, prompts: Sequence[str | list[int]], options: LoadOptions,
    modes: Sequence[str], rounds: int,
) -> tuple[Rows, Rows]:  # fmt: skip
    """A warm-up per cluster and mode, then ``rounds`` rounds: each run's figures and its messages by
    subject, ``[variant][mode]``, rounds in order."""
    names = list(clusters)
    runs: Rows = {name: {mode: [] for mode in modes} for name in names}
    by_subject: Rows = {name: {mode: [] for mode in modes} for name in names}
    warm = dataclasses.replace(
        options, requests=min(options.concurrency, len(prompts)), max_tokens=4, subjects=False
    )
    for cluster in clusters.values():  # connections, first compilations, placement
        for mode in modes:
            measure(cluster, model, prompts[: warm.requests], warm, mode == "stream")
    for index in range(rounds):
        for mode in modes:
            for name in rotation(names, index):
                figures, counts = measure(clusters[name], model, prompts, options, mode == "stream")
                runs[name][mode].append(figures)
                by_subject[name][mode].append(counts)
                click.echo(f"round {index + 1}/{rounds} " + progress_line(mode, name, figures))
    return runs, by_subject


@click.command("path-cpu")
@click.option(
    "--requests", type=click.IntRange(min=1), default=200, show_default=True, help="Completions per run."
)
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option(
    "--max-tokens", type=click.IntRange(min=1), default=128, show_default=True, help="Output tokens each."
)
@click.option("--concurrency", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=4, show_default=True,
              help="Each runs every variant once per mode; figures are medians over rounds.")  # fmt: skip
@click.option("--whole", is_flag=True, help="Also the same load not streamed.")
@click.option("--variant", "variant_texts", multiple=True, metavar="NAME=SOURCE_TREE",
              help="Run the frontend, scheduler and agent of this source tree (repeatable; alternating "
                   "by round; the first is the reference of the paired ratios). Default: this tree. "
                   "An earlier commit's tree: git archive COMMIT | tar -x -C DIR.")  # fmt: skip
@click.option("--no-scheduler", is_flag=True, help="No scheduler: the frontends place requests themselves.")
@click.option("--subjects", is_flag=True,
              help="Also count bus messages per subject (a subscriber to '>': nats-server's CPU then "
                   "includes its deliveries).")  # fmt: skip
@click.option("--token-ids", is_flag=True, help="Prompts as token ids (no tokenization in the frontend).")
@click.option("--profile", "profile_name", default="llama-7b-a10", show_default=True,
              help="The sim engine's timing profile (its vocabulary becomes the checkpoint's).")  # fmt: skip
@click.option("--time-scale", type=click.FloatRange(min=0, min_open=True), default=0.5, show_default=True,
              help="The sim engine's step time multiplier.")  # fmt: skip
@click.option("--ready-timeout", type=float, default=180.0, show_default=True, help="Clusters' start, s.")
@click.option("--client-timeout", type=float, default=600.0, show_default=True, help="Per request, s.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_path_cpu(
    requests: int, prompt_tokens: int, max_tokens: int, concurrency: int, rounds: int, whole: bool,
    variant_texts: tuple[str, ...], no_scheduler: bool, subjects: bool, token_ids: bool, profile_name: str,
    time_scale: float, ready_timeout: float, client_timeout: float, json_path: Path | None,
) -> None:  # fmt: skip
    """CPU per request of the frontend, scheduler, agent and nats-server, and bus messages per request,
    on a sim cluster (one per --variant, alternating)."""
    try:
        variants = parse_variants(variant_texts, Path(__file__).resolve().parents[1])
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--variant") from error
    for name, tree in variants:
        if not (tree / "frontend" / "cli.py").is_file():
            raise click.BadParameter(f"{name}: {tree} holds no frontend/cli.py", param_hint="--variant")
    options = LoadOptions(
        requests, prompt_tokens, max_tokens, concurrency, token_ids, subjects, client_timeout
    )
    modes = ("stream", "whole") if whole else ("stream",)
    load_before = os.getloadavg()
    with scratch_dir("shoal-bench-path-cpu-") as work:
        checkpoint, profile = sim_inputs(work, profile_name)
        prompts = build_prompts(checkpoint, options)
        clusters: dict[str, SimCluster] = {}
        try:
            for name, tree in variants:
                clusters[name] = start_cluster(
                    (name, tree), work / name, checkpoint=checkpoint, profile=profile, time_scale=time_scale,
                    scheduler=not no_scheduler,
                )  # fmt: skip
            wait_ready(list(clusters.values()), ready_timeout)
            runs, by_subject = run_rounds(clusters, str(checkpoint), prompts, options, modes, rounds)
        finally:
            for cluster in clusters.values():
                cluster.stop()
    click.echo("\n" + table(runs, rounds))
    if subjects:
        click.echo("\n" + subjects_table(by_subject))
    if json_path is not None:
        meta = {
            "requests": requests, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            "concurrency": concurrency, "rounds": rounds, "modes": list(modes), "token_ids": token_ids,
            "no_scheduler": no_scheduler, "profile": profile_name, "time_scale": time_scale,
            "variants": {name: str(tree) for name, tree in variants}, "cpus": os.cpu_count(),
            "load_average_before": load_before, "load_average_end": os.getloadavg(),
        }  # fmt: skip
        result: dict[str, Any] = {"meta": meta, "runs": runs, "summary": summarize(runs)}
        if subjects:
            result["subjects_per_request"] = by_subject
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1))
        click.echo(f"wrote {json_path}")
