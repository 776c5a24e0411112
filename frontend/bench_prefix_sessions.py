"""``shoal bench prefix``'s chat sessions: the workload of a round, each turn's prompt, the client
that sends them (httpx, SSE streams) and one side's summary of what the turns measured.

The sessions come in groups; the sessions of a group share a system prompt, and each turn's prompt
is the conversation so far: the system prompt, every earlier user message and answer, and a new
user message (a chat client's prompt grows by one exchange per turn). A session waits a think time
between its turns and the sessions start spread over a ramp, so turns of different sessions
overlap. Every request streams, greedy, ``ignore_eos``, with usage. Nothing here starts a server.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from frontend.bench_serve import percentile

__all__ = [
    "Session",
    "TurnRecord",
    "Workload",
    "build_sessions",
    "cached_tokens_of",
    "chat_messages",
    "first_token_chunk",
    "run_sessions",
    "summarize",
]

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
    #: the answer's text (the next turn's prompt holds it)
    answer: str = ""


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
            record.answer = answers[-1]
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
