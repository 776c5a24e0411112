"""``shoal bench prefix``: automatic prefix caching, live, with the cache on and off side by side.

**Sessions** (the default mode): multi-turn chat sessions against ``shoal up``
(torch engine, preset ``small``, two instances, one torch thread each). The
sessions come in groups; the sessions of a group share a system prompt, and
each turn's prompt is the conversation so far: the system prompt, every earlier
user message and answer, and a new user message (a chat client's prompt grows
by one exchange per turn). A session waits a think time between its turns and
the sessions start spread over a ramp, so turns of different sessions overlap.
Every request streams (httpx, SSE), greedy, ``ignore_eos``, with usage.

Two clusters run at once, one with the engines' prefix cache on and one with
``shoal up --no-prefix-cache``; each round runs the same sessions on one, then
on the other (the order alternates over rounds; the idle cluster costs both the
same). Each round has sessions of its own (other system prompts), so a cache
warmed by an earlier round serves nothing. Reported per side: TTFT p50 and p99
(the time to the first chunk that carries a generated token; shoal sends the
chunk announcing the assistant's role before any token is computed, which is
not counted), on the first turn and on later turns, and the hit rate: cached
prompt tokens over prompt tokens, from ``usage.prompt_tokens_details.
cached_tokens``, else from the agents' ``/metrics`` prefix-cache counters.
Figures are medians over rounds; ``ttft_p50_ratio`` is each round's p50 without
the cache over the p50 with it, the median over rounds.

**vllm-repetition** (``--mode vllm-repetition``): ``vllm bench serve --dataset-name
prefix_repetition`` (prompts sharing one of a few prefixes) against ``shoal up
--engine vllm`` and against ``vllm serve --enable-prefix-caching``, one server
at a time, with the machinery of :mod:`frontend.bench_vllm_serve`; needs vLLM
(``./install.sh --vllm``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import click

from bus.bench_progress import BenchProgress
from bus.server import die_with_parent, free_port
from frontend.bench_cli import scratch_dir
from frontend.bench_serve import percentile
from frontend.bench_vllm_serve import EngineOptions, Server, parse_result
from frontend.up import _health

__all__ = [
    "CacheCounters",
    "Session",
    "TurnRecord",
    "Workload",
    "bench_prefix",
    "build_sessions",
    "cached_tokens_of",
    "chat_messages",
    "first_token_chunk",
    "paired_ratios",
    "parse_cache_counters",
    "repetition_client_command",
    "summarize",
    "up_command",
    "vllm_serve_command",
]

_SHOAL = [sys.executable, "-c", "from frontend.cli import main; main()"]
_VLLM = [sys.executable, "-m", "agents.engines.vllm_engine.vllm_cli"]
#: the two sides of a sessions run: the engines' prefix cache on, and off (``--no-prefix-cache``)
SIDES = ("on", "off")
_WORDS = (
    "river",
    "stone",
    "lantern",
    "harbor",
    "quiet",
    "copper",
    "meadow",
    "signal",
    "winter",
    "orchard",
    "paper",
    "thunder",
    "velvet",
    "engine",
    "garden",
    "silver",
    "market",
    "shadow",
    "bridge",
    "candle",
    "falcon",
    "glacier",
    "island",
    "jasmine",
    "kettle",
    "ladder",
    "mirror",
    "needle",
    "ocean",
    "pepper",
)


# ---------------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    """The sessions of one round: ``groups`` x ``sessions_per_group`` sessions of ``turns`` turns."""

    groups: int = 2
    sessions_per_group: int = 4
    turns: int = 4
    #: words of each group's system prompt (about 6 tokens a word with the presets' byte tokenizer)
    system_words: int = 160
    user_words: int = 12
    answer_tokens: int = 32
    #: mean think time between a session's turns, seconds (exponential, at most 3x the mean)
    think_s: float = 1.0
    #: the sessions start spread over this many seconds
    ramp_s: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        counts = (
            self.groups,
            self.sessions_per_group,
            self.turns,
            self.system_words,
            self.user_words,
            self.answer_tokens,
        )
        if min(counts) < 1:
            raise ValueError("groups, sessions, turns, system and user words and answer tokens must be >= 1")
        if self.think_s < 0 or self.ramp_s < 0:
            raise ValueError("think and ramp times must be >= 0")

    @property
    def num_sessions(self) -> int:
        return self.groups * self.sessions_per_group

    @property
    def num_requests(self) -> int:
        return self.num_sessions * self.turns


@dataclass(frozen=True)
class Session:
    """One chat session: its system prompt (shared with its group), user messages and timing."""

    name: str
    group: int
    system: str
    users: tuple[str, ...]
    #: seconds after the round starts that its first turn is sent
    start_s: float
    #: seconds it waits after each turn but the last
    think_s: tuple[float, ...]


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def build_sessions(workload: Workload, round_index: int) -> list[Session]:
    """The sessions of round ``round_index``: the same for both sides, other prompts in every round."""
    rng = random.Random(f"bench-prefix:{workload.seed}:{round_index}")
    cap = 3 * workload.think_s
    sessions = []
    for group in range(workload.groups):
        system = f"Assistant {round_index}-{group}. " + _words(rng, workload.system_words)
        for index in range(workload.sessions_per_group):
            users = tuple(
                f"Question {turn + 1}: " + _words(rng, workload.user_words) for turn in range(workload.turns)
            )
            think = tuple(
                min(cap, rng.expovariate(1 / workload.think_s)) if workload.think_s else 0.0
                for _ in range(workload.turns - 1)
            )
            start = rng.uniform(0, workload.ramp_s)
            sessions.append(Session(f"r{round_index}-g{group}-s{index}", group, system, users, start, think))
    return sessions


def chat_messages(session: Session, answers: Sequence[str]) -> list[dict[str, str]]:
    """The messages of the turn after ``answers``: the system prompt, each earlier exchange, the next
    user message."""
    turn = len(answers)
    if turn >= len(session.users):
        raise ValueError(f"session {session.name} has {len(session.users)} turns; {turn} answered")
    messages = [{"role": "system", "content": session.system}]
    for user, answer in zip(session.users, answers, strict=False):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": session.users[turn]})
    return messages


# ---------------------------------------------------------------------------------------- results


@dataclass
class TurnRecord:
    """What one turn's request measured (``error`` set when it failed)."""

    session: str
    group: int
    turn: int
    sent_s: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    #: ``usage.prompt_tokens_details.cached_tokens``; None when the answer does not say
    cached_tokens: int | None = None
    completion_tokens: int = 0
    error: str = ""


def cached_tokens_of(usage: Mapping[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an OpenAI usage object; None if absent."""
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, Mapping):
        return None
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def first_token_chunk(chunk: Mapping[str, Any]) -> bool:
    """Whether a chat completion chunk carries a generated token (text or not): a choice that is not
    the announcement of the assistant's role, which a server may send before any token exists."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if "role" not in delta or choice.get("finish_reason") is not None:
            return True
    return False


def summarize(records: Sequence[TurnRecord]) -> dict[str, Any]:
    """One side's figures over ``records``: TTFT p50/p99 (all turns, first turns, later turns, ms),
    prompt and cached tokens, and the hit rate (None when some answer did not say its cached tokens)."""
    ok = [r for r in records if not r.error and r.ttft_s is not None]
    ttft = [1000 * (r.ttft_s or 0.0) for r in ok]
    first = [1000 * (r.ttft_s or 0.0) for r in ok if r.turn == 0]
    later = [1000 * (r.ttft_s or 0.0) for r in ok if r.turn > 0]
    prompt = sum(r.prompt_tokens for r in ok)
    known = ok and all(r.cached_tokens is not None for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok) if known else None
    by_turn = {}
    for turn in sorted({r.turn for r in ok}):
        values = [1000 * (r.ttft_s or 0.0) for r in ok if r.turn == turn]
        by_turn[str(turn + 1)] = percentile(values, 0.5)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "ttft_p50_ms": percentile(ttft, 0.5),
        "ttft_p99_ms": percentile(ttft, 0.99),
        "ttft_p50_first_turn_ms": percentile(first, 0.5),
        "ttft_p50_later_turns_ms": percentile(later, 0.5),
        "ttft_p50_by_turn_ms": by_turn,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": None if cached is None or not prompt else cached / prompt,
    }


@dataclass(frozen=True)
class CacheCounters:
    """Prompt tokens looked up in the agents' prefix caches, and of those found cached (cumulative)."""

    queries: float
    hits: float

    def __sub__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(self.queries - other.queries, self.hits - other.hits)

    def __add__(self, other: CacheCounters) -> CacheCounters:
        return CacheCounters(self.queries + other.queries, self.hits + other.hits)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None


#: ``shoal_prefix_cache_queries_total`` (agents), ``vllm_prefix_cache_hits_total`` (vLLM's, ``:`` made
#: ``_``), ...: the counters themselves, not their ``_created`` timestamps
_COUNTER = re.compile(r"^(\w*prefix_cache_(queries|hits)(?:_total)?)(\{[^}]*\})?\s+(\S+)$", re.MULTILINE)


def parse_cache_counters(text: str) -> CacheCounters | None:
    """The prefix-cache query and hit counters of a ``/metrics`` page (summed over labels); None
    when the page has neither."""
    totals = {"queries": 0.0, "hits": 0.0}
    seen = False
    for _name, kind, _labels, value in _COUNTER.findall(text):
        with contextlib.suppress(ValueError):
            totals[kind] += float(value)
            seen = True
    return CacheCounters(totals["queries"], totals["hits"]) if seen else None


def scrape_cache_counters(urls: Sequence[str]) -> CacheCounters | None:
    """:func:`parse_cache_counters` of every agent's ``/metrics``, added up; None if one lacks them."""
    total = CacheCounters(0.0, 0.0)
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5.0) as response:
                counters = parse_cache_counters(response.read().decode())
        except OSError:
            return None
        if counters is None:
            return None
        total = total + counters
    return total


def paired_ratios(on: Sequence[Mapping[str, Any]], off: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each round's TTFT p50 and p99 without the cache over with it, and the medians of those ratios
    (rounds minutes apart see a machine of another speed; the sides of one round run back to back)."""
    if len(on) != len(off):
        raise ValueError(f"{len(on)} rounds with the cache against {len(off)} without")
    paired: dict[str, Any] = {}
    for key in ("ttft_p50_ms", "ttft_p99_ms", "ttft_p50_later_turns_ms"):
        ratios = [b[key] / a[key] if a[key] else float("nan") for a, b in zip(on, off, strict=True)]
        name = key.removesuffix("_ms")
        paired[f"{name}_ratios"] = ratios
        paired[f"{name}_ratio"] = statistics.median(ratios) if ratios else float("nan")
    return paired


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def combine_rounds(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One side's figures over rounds: the median of each round's figure; tokens and errors added up."""
    combined: dict[str, Any] = {"rounds": len(rounds)}
    for key in (
        "ttft_p50_ms",
        "ttft_p99_ms",
        "ttft_p50_first_turn_ms",
        "ttft_p50_later_turns_ms",
        "hit_rate",
    ):
        combined[key] = _median([r.get(key) for r in rounds])
    for key in ("requests", "errors", "prompt_tokens"):
        combined[key] = sum(int(r.get(key) or 0) for r in rounds)
    turns = sorted({t for r in rounds for t in r.get("ttft_p50_by_turn_ms", {})}, key=int)
    combined["ttft_p50_by_turn_ms"] = {
        t: _median([r.get("ttft_p50_by_turn_ms", {}).get(t) for r in rounds]) for t in turns
    }
    combined["hit_rate_source"] = rounds[0].get("hit_rate_source") if rounds else None
    return combined


# ---------------------------------------------------------------------------------------- the client


async def _turn(
    http: Any, model: str, messages: list[dict[str, str]], workload: Workload, record: TurnRecord
) -> str:
    """Send one turn, fill ``record``; the answer's text."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": workload.answer_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts: list[str] = []
    started = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {json.dumps(chunk['error'])[:200]}")
            if record.ttft_s is None and first_token_chunk(chunk):
                record.ttft_s = time.perf_counter() - started
            for choice in chunk.get("choices") or ():
                parts.append((choice.get("delta") or {}).get("content") or "")
            usage = chunk.get("usage")
            if usage:
                record.prompt_tokens = int(usage.get("prompt_tokens", 0))
                record.completion_tokens = int(usage.get("completion_tokens", 0))
                record.cached_tokens = cached_tokens_of(usage)
    record.e2e_s = time.perf_counter() - started
    return "".join(parts)


async def _session(
    http: Any, model: str, session: Session, workload: Workload, started: float, records: list[TurnRecord]
) -> None:
    await asyncio.sleep(session.start_s)
    answers: list[str] = []
    for turn in range(len(session.users)):
        record = TurnRecord(session.name, session.group, turn, time.perf_counter() - started)
        records.append(record)
        try:
            answers.append(await _turn(http, model, chat_messages(session, answers), workload, record))
        except Exception as exc:  # the session cannot go on without its answer: the rest is not sent
            record.error = f"{type(exc).__name__}: {exc}"[:300]
            return
        if turn < len(session.think_s):
            await asyncio.sleep(session.think_s[turn])


async def run_sessions(
    url: str, model: str, sessions: Sequence[Session], workload: Workload, timeout_s: float
) -> list[TurnRecord]:
    """Every session at once (each its turns in order); the turns' records. Bounded by ``timeout_s``."""
    import httpx

    records: list[TurnRecord] = []
    limits = httpx.Limits(max_connections=len(sessions) + 4, max_keepalive_connections=len(sessions) + 4)
    async with httpx.AsyncClient(
        base_url=url, timeout=httpx.Timeout(120.0, connect=10.0), limits=limits
    ) as http:
        started = time.perf_counter()
        tasks = [
            asyncio.ensure_future(_session(http, model, s, workload, started, records)) for s in sessions
        ]
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for record in records:
        if record.e2e_s is None and not record.error:
            record.error = f"not ended within the run's bound of {timeout_s:g}s"
    return records


# ---------------------------------------------------------------------------------------- the servers


def up_command(
    engine: str, model: str, instances: int, port: int, log_dir: Path, *, prefix_cache: bool, threads: int = 1
) -> list[str]:
    """``shoal up`` of one side: ``--no-prefix-cache`` where ``prefix_cache`` is False."""
    return [
        *_SHOAL,
        "up",
        "--engine",
        engine,
        "--model",
        model,
        "--instances",
        str(instances),
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--log-dir",
        str(log_dir),
        "--ready-timeout",
        "600",
        *([] if prefix_cache else ["--no-prefix-cache"]),
    ]


_AGENT_METRICS = re.compile(r"^agent\s+\S+\s+pid \d+\s+metrics (http://\S+)", re.MULTILINE)


def agent_metrics_urls(up_output: str) -> list[str]:
    """The agents' ``/metrics`` URLs that ``shoal up`` printed."""
    return _AGENT_METRICS.findall(up_output)


def _spawn(kind: str, command: list[str], url: str, log_path: Path) -> Server:
    log: IO[bytes] = open(log_path, "ab")
    try:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    finally:
        log.close()
    return Server(kind, process, url, log_path)


def _wait_instances(server: Server, instances: int, timeout_s: float) -> None:
    """Until ``server``'s frontend lists ``instances`` ready instances; a ClickException if it dies first."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = _health(server.url)
        if health is not None and len(health.get("instances") or ()) >= instances:
            return
        if server.process.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(server.log_path.read_text(errors="replace").splitlines()[-20:])
            raise click.ClickException(f"shoal up ({server.kind}) did not start ({server.log_path}):\n{tail}")
        time.sleep(0.5)


def _check_no_prefix_cache_option() -> None:
    """``shoal up --no-prefix-cache`` exists (the side without the cache needs it)."""
    from frontend.up import up

    names = {opt for param in up.params for opt in (*param.opts, *param.secondary_opts)}
    if "--no-prefix-cache" not in names:
        raise click.ClickException(
            "this shoal up has no --no-prefix-cache: the side without the cache cannot run"
        )


@contextlib.contextmanager
def _clusters(
    engine: str, model: str, instances: int, threads: int, log_dir: Path, ready_timeout_s: float
) -> Iterator[dict[str, Server]]:
    """Both sides' ``shoal up`` at once (started together, ready together), stopped at the end."""
    servers: dict[str, Server] = {}
    try:
        for side in SIDES:
            port = free_port()
            command = up_command(
                engine,
                model,
                instances,
                port,
                log_dir / f"up-{side}",
                prefix_cache=side == "on",
                threads=threads,
            )
            servers[side] = _spawn(side, command, f"http://127.0.0.1:{port}", log_dir / f"up-{side}.log")
        for server in servers.values():
            _wait_instances(server, instances, ready_timeout_s)
        yield servers
    finally:
        for server in servers.values():
            server.stop(grace_s=30.0)


# ---------------------------------------------------------------------------------------- sessions mode


def run_side(
    server: Server, model: str, sessions: Sequence[Session], workload: Workload, timeout_s: float
) -> tuple[list[TurnRecord], dict[str, Any]]:
    """One side's run of ``sessions``: its records and :func:`summarize` (with the hit rate from the
    agents' counters where the answers do not say)."""
    from bus import event_loop

    urls = agent_metrics_urls(server.log_path.read_text(errors="replace"))
    before = scrape_cache_counters(urls) if urls else None
    records = event_loop.run(run_sessions(server.url, model, sessions, workload, timeout_s))
    summary = summarize(records)
    summary["hit_rate_source"] = "usage" if summary["hit_rate"] is not None else None
    after = scrape_cache_counters(urls) if urls else None
    if before is not None and after is not None:
        delta = after - before
        summary["agent_prefix_cache"] = {
            "queries": delta.queries,
            "hits": delta.hits,
            "hit_rate": delta.hit_rate,
        }
        if summary["hit_rate"] is None and delta.hit_rate is not None:
            summary["hit_rate"], summary["hit_rate_source"] = delta.hit_rate, "agents' /metrics"
    return records, summary


def _table(results: Mapping[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="shoal bench prefix: multi-turn sessions, prefix cache on vs off (medians of rounds)")
    for column in (
        "cache",
        "requests",
        "errors",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "first turn p50",
        "later turns p50",
        "hit rate",
    ):
        table.add_column(column, justify="left" if column == "cache" else "right")

    def ms(value: float | None) -> str:
        return "-" if value is None or value != value else f"{value:.0f}"

    for side in SIDES:
        s = results[side]
        rate = "-" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%"
        table.add_row(
            side,
            str(s["requests"]),
            str(s["errors"]),
            ms(s["ttft_p50_ms"]),
            ms(s["ttft_p99_ms"]),
            ms(s["ttft_p50_first_turn_ms"]),
            ms(s["ttft_p50_later_turns_ms"]),
            rate,
        )
    return table


def _plot(results: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for side, style in zip(SIDES, ("o-", "s--"), strict=True):
        by_turn = results[side]["ttft_p50_by_turn_ms"]
        turns = [int(t) for t in by_turn]
        left.plot(turns, [by_turn[t] for t in by_turn], style, label=f"cache {side}")
    left.set_xticks([int(t) for t in results[SIDES[0]]["ttft_p50_by_turn_ms"]])
    left.set_xlabel("turn")
    left.set_ylabel("TTFT p50 (ms)")
    left.set_title("TTFT by turn")
    left.legend()
    rates = [100 * (results[side]["hit_rate"] or 0.0) for side in SIDES]
    right.bar([f"cache {side}" for side in SIDES], rates, color=("tab:blue", "tab:orange"))
    right.set_ylabel("prompt tokens cached (%)")
    right.set_title("hit rate")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _sessions_mode(
    log_dir: Path,
    engine: str,
    model: str,
    instances: int,
    threads: int,
    workload: Workload,
    rounds: int,
    ready_timeout: float,
    run_timeout: float,
    json_path: Path | None,
    png_path: Path | None,
) -> None:
    from rich.console import Console

    _check_no_prefix_cache_option()
    progress = BenchProgress("prefix", 1 + 2 * rounds)
    progress.phase(f"starting two clusters ({instances} {engine} agents of {model} each; cache on and off)")
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    turns: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    with _clusters(engine, model, instances, threads, log_dir, ready_timeout) as servers:
        for round_index in range(rounds):
            sessions = build_sessions(workload, round_index)
            order = SIDES if round_index % 2 == 0 else SIDES[::-1]
            for side in order:
                progress.phase(
                    f"round {round_index + 1}/{rounds}: {len(sessions)} sessions of {workload.turns} "
                    f"turns, cache {side}"
                )
                load_before = os.getloadavg()[0]
                records, summary = run_side(servers[side], model, sessions, workload, run_timeout)
                summary["load_before"], summary["load_after"] = load_before, os.getloadavg()[0]
                summary["first"] = side == order[0]
                runs[side].append(summary)
                failed = next((r for r in records if r.error), None)
                if failed is not None:
                    progress.note(
                        f"cache {side}: {failed.session} turn {failed.turn + 1} failed: {failed.error}"
                    )
                turns[side].extend({"round": round_index, **asdict(r)} for r in records)
                rate = "-" if summary["hit_rate"] is None else f"{100 * summary['hit_rate']:.1f}%"
                progress.note(
                    f"cache {side}: TTFT p50 {summary['ttft_p50_ms']:.0f} ms, p99 "
                    f"{summary['ttft_p99_ms']:.0f} ms, hit rate {rate}, {summary['errors']} errors"
                )
    progress.finish()
    results: dict[str, Any] = {side: combine_rounds(runs[side]) for side in SIDES}
    results["paired"] = paired_ratios(runs["on"], runs["off"])
    Console(width=120).print(_table(results))
    paired = results["paired"]
    click.echo(
        f"TTFT without the cache over with it (median of {rounds} paired rounds): p50 "
        f"{paired['ttft_p50_ratio']:.2f}x, p99 {paired['ttft_p99_ratio']:.2f}x, later turns p50 "
        f"{paired['ttft_p50_later_turns_ratio']:.2f}x"
    )
    source = results["on"].get("hit_rate_source")
    if source is None:
        click.echo(
            "hit rate: neither the answers' usage nor the agents' /metrics say how many tokens were cached"
        )
    meta = {
        "mode": "sessions",
        "engine": engine,
        "model": model,
        "instances": instances,
        "threads": threads,
        "rounds": rounds,
        "workload": asdict(workload),
        "cpus": os.cpu_count(),
        "load_average_end": os.getloadavg(),
        "commands": {
            side: up_command(
                engine, model, instances, 0, Path("LOG"), prefix_cache=side == "on", threads=threads
            )[3:]
            for side in SIDES
        },
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"meta": meta, "results": results, "runs": runs}, indent=2))
        click.echo(f"wrote {json_path}")
    (log_dir / "turns.json").write_text(json.dumps(turns))
    if png_path is not None:
        _plot(results, png_path)
        click.echo(f"wrote {png_path}")


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


def _run_client(command: list[str], log_path: Path, timeout_s: float) -> None:
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        try:
            status = process.wait(timeout_s)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
            process.wait()
            raise
    if status != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise click.ClickException(f"vllm bench serve failed ({log_path}):\n{tail}")


def _repetition_mode(
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
            server = _spawn(kind, command, f"http://127.0.0.1:{port}", log_dir / f"{kind}-{port}.log")
            try:
                if kind == "vllm":
                    server.wait_ready(ready_timeout)
                else:
                    _wait_instances(server, 1, ready_timeout)
                before = _server_counters(server)
                name = f"{kind}-r{round_index}.json"
                _run_client(
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
        kind: {key: _median([r.get(key) for r in runs[kind]]) for key in runs[kind][0]} for kind in kinds
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


# ---------------------------------------------------------------------------------------- the command


@click.command("prefix")
@click.option(
    "--mode",
    type=click.Choice(["sessions", "vllm-repetition"]),
    default="sessions",
    show_default=True,
    help="sessions: multi-turn chats against shoal up, cache on vs off; vllm-repetition: vllm bench "
    "serve's prefix_repetition against shoal up --engine vllm and vllm serve.",
)
@click.option(
    "--engine",
    type=click.Choice(["torch", "vllm"]),
    default="torch",
    show_default=True,
    help="sessions: the agents' engine.",
)
@click.option(
    "--model",
    default=None,
    help="sessions: the model (default: torch preset small); vllm-repetition: "
    "a checkpoint folder (default: a small random one, built here).",
)
@click.option("--instances", type=int, default=2, show_default=True, help="sessions: agents per cluster.")
@click.option("--threads", type=int, default=1, show_default=True, help="sessions: torch threads per agent.")
@click.option("--groups", type=int, default=2, show_default=True, help="System prompts (each its group).")
@click.option(
    "--sessions", "sessions_per_group", type=int, default=4, show_default=True, help="Sessions per group."
)
@click.option("--turns", type=int, default=4, show_default=True, help="Turns per session.")
@click.option("--system-words", type=int, default=160, show_default=True, help="Words of a system prompt.")
@click.option("--user-words", type=int, default=12, show_default=True, help="Words of a user message.")
@click.option("--answer-tokens", type=int, default=32, show_default=True, help="Tokens of each answer.")
@click.option("--think", type=float, default=1.0, show_default=True, help="Mean think time between turns, s.")
@click.option(
    "--rounds",
    type=int,
    default=3,
    show_default=True,
    help="Rounds (each side once per round, the first side alternating); medians are reported.",
)
@click.option("--num-prompts", type=int, default=32, show_default=True, help="vllm-repetition: prompts.")
@click.option(
    "--concurrency", type=int, default=4, show_default=True, help="vllm-repetition: max concurrency."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--ready-timeout", type=float, default=600.0, show_default=True, help="Per server start, s.")
@click.option("--run-timeout", type=float, default=600.0, show_default=True, help="Per side and round, s.")
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the servers' logs and each turn's record here (default: a temporary folder).",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option(
    "--png",
    "png_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="sessions: TTFT by turn and hit rate of both sides (needs matplotlib: the bench extra).",
)
def bench_prefix(
    mode: str,
    engine: str,
    model: str | None,
    instances: int,
    threads: int,
    groups: int,
    sessions_per_group: int,
    turns: int,
    system_words: int,
    user_words: int,
    answer_tokens: int,
    think: float,
    rounds: int,
    num_prompts: int,
    concurrency: int,
    seed: int,
    ready_timeout: float,
    run_timeout: float,
    log_dir: Path | None,
    json_path: Path | None,
    png_path: Path | None,
) -> None:
    """TTFT and prefix-cache hit rate of multi-turn chat sessions, the cache on vs off.

    The defaults (8 sessions of 4 turns, 3 rounds, two clusters of 2 torch small agents) take about
    3 minutes on two cores.
    """
    if rounds < 1 or instances < 1 or threads < 1:
        raise click.UsageError("--rounds, --instances and --threads must be positive")
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = stack.enter_context(scratch_dir("shoal-bench-prefix-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        if mode == "vllm-repetition":
            workload = Repetition(num_prompts=num_prompts, concurrency=concurrency, seed=seed)
            _repetition_mode(
                log_dir,
                None if model is None else Path(model),
                workload,
                rounds,
                ready_timeout,
                run_timeout,
                json_path,
            )
            return
        if engine == "vllm" and model is None:
            raise click.UsageError("--engine vllm needs --model CHECKPOINT_FOLDER")
        try:
            sessions = Workload(
                groups, sessions_per_group, turns, system_words, user_words, answer_tokens, think, seed=seed
            )
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        _sessions_mode(
            log_dir,
            engine,
            model or "small",
            instances,
            threads,
            sessions,
            rounds,
            ready_timeout,
            run_timeout,
            json_path,
            png_path,
        )
