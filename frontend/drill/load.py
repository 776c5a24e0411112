"""The drill's load: an open-loop stream of OpenAI completions, and what became of each request.

:class:`LoadGenerator` sends requests at the scenario's rate (Poisson
arrivals, seeded) with httpx to ``/v1/completions``; a share streams (SSE), a
share is greedy (temperature 0, one of a few fixed prompts), and each greedy
answer is compared with its no-fault text (:mod:`frontend.drill.greedy`: the
prompt's answer recorded before the load, or on the sim engine the text of the
tokens computed from the request id). Every request asks for exactly ``output_tokens``
tokens (``ignore_eos``), so a complete answer is recognisable. Each ends as
one :class:`Outcome`:

* ``ok`` — the whole answer (``finish_reason`` ``length`` and the token count asked for);
* ``error`` — a clear error the client can retry: an HTTP error status with an
  OpenAI error body, an error chunk in the stream, or a refused / reset connection;
* ``lost`` — never ended within ``request_timeout_s``, or ended short without an error;
* ``rejected`` — a 4xx other than 429: the request itself was wrong (a scenario whose
  prompt and output do not fit the model, say), which fails the drill too.

A greedy ``ok`` whose text differs from its no-fault text is a ``mismatch``; its
record keeps how many characters were compared (``compared_chars``; None: not compared).
"""

from __future__ import annotations

import asyncio
import enum
import json
import random
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx

from bus.event_loop import cancel_and_wait
from frontend.drill.greedy import GreedyText, RecordedText
from frontend.drill.scenario import LoadSpec

__all__ = ["LoadGenerator", "Outcome", "RequestRecord"]

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
)
_NUM_GREEDY_PROMPTS = 3
_LINE_END = re.compile(r"\r\n|\n|\r")


class Outcome(enum.StrEnum):
    PENDING = "pending"
    OK = "ok"
    ERROR = "error"
    LOST = "lost"
    MISMATCH = "mismatch"
    REJECTED = "rejected"


@dataclass
class RequestRecord:
    index: int
    sent_at: float  # seconds since the drill's start
    stream: bool
    greedy: bool
    prompt_id: int
    outcome: Outcome = Outcome.PENDING
    ended_at: float | None = None
    first_token_at: float | None = None
    num_tokens: int = 0
    status: int | None = None
    detail: str = ""
    #: the id the frontend gave the request (the response's ``id``)
    request_id: str = ""
    #: characters of a greedy answer compared with its no-fault text; None when not compared
    compared_chars: int | None = None
    #: no end within the load's ``request_timeout_s`` (or still running when the drill ended): it hung
    timed_out: bool = False
    #: an ``error``'s source: ``answer`` (the frontend answered with an error status or an error chunk)
    #: or ``connection`` (refused, reset or broken off: no frontend to answer)
    error_source: str = ""
    #: the answer's ``usage``: prompt tokens, and of those found in the prefix cache
    #: (``prompt_tokens_details.cached_tokens``; None: not said)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = field(default="", repr=False)
    prompt: str = field(default="", repr=False)

    @property
    def latency_s(self) -> float | None:
        return None if self.ended_at is None else self.ended_at - self.sent_at


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


class LoadGenerator:
    """Sends the scenario's load; see the module docstring. ``clock`` is seconds since the drill began."""

    def __init__(
        self, spec: LoadSpec, url: str, model: str, clock: Callable[[], float], greedy: GreedyText | None
    ) -> None:
        self.spec = spec
        #: what a greedy answer is compared with (None: not compared)
        self.greedy = greedy
        self.url = url
        self.model = model
        self.clock = clock
        self.rng = random.Random(spec.seed)
        prompt_rng = random.Random(spec.seed + 1)
        #: the start every prompt shares (``prefix_words``; its own random stream, so the rest is unchanged)
        self.prefix = ""
        if spec.prefix_words:
            self.prefix = _prompt(random.Random(spec.seed + 2), spec.prefix_words) + " "
        self.greedy_prompts = [
            self.prefix + _prompt(prompt_rng, spec.prompt_words) for _ in range(_NUM_GREEDY_PROMPTS)
        ]
        self.records: list[RequestRecord] = []
        #: the greedy prompts' reference requests, sent before the load (not counted in ``records``)
        self.references: list[RequestRecord] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._http = httpx.AsyncClient(
            base_url=url,
            timeout=httpx.Timeout(spec.request_timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
        )

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        await self._http.aclose()

    def _body(self, record: RequestRecord, prompt: str) -> dict[str, object]:
        body: dict[str, object] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.spec.output_tokens,
            "ignore_eos": True,
            "stream": record.stream,
            "temperature": 0.0 if record.greedy else 1.0,
        }
        if not record.greedy:
            body["seed"] = self.rng.randrange(2**31)
        return body

    async def record_references(self) -> None:
        """Record each greedy prompt's no-fault text (sent one by one before the load starts), when
        the comparison is with recorded text."""
        if not isinstance(self.greedy, RecordedText):
            return
        for prompt_id, prompt in enumerate(self.greedy_prompts):
            record = RequestRecord(-1 - prompt_id, self.clock(), False, True, prompt_id)
            self.references.append(record)
            await self._send(record, prompt)
            if record.outcome is not Outcome.OK:
                raise RuntimeError(f"the reference request failed ({record.outcome}): {record.detail}")
            self.greedy.texts[prompt_id] = record.text

    async def run(self, until: float, stop: asyncio.Event | None = None) -> None:
        """Send requests until the clock reads ``until`` (open loop: never waits for answers)."""
        while self.clock() < until and not (stop is not None and stop.is_set()):
            greedy = self.rng.random() < self.spec.greedy_share
            record = RequestRecord(
                len(self.records),
                self.clock(),
                self.rng.random() < self.spec.stream_share,
                greedy,
                self.rng.randrange(_NUM_GREEDY_PROMPTS) if greedy else -1,
            )
            prompt = (
                self.greedy_prompts[record.prompt_id]
                if greedy
                else self.prefix + _prompt(self.rng, self.spec.prompt_words)
            )
            self.records.append(record)
            task = asyncio.ensure_future(self._send(record, prompt))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            await asyncio.sleep(self.rng.expovariate(self.spec.rate))

    async def wait_all(self, timeout_s: float) -> None:
        """Wait for every request in flight to end (each has its own timeout; this bounds the wait)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        for record in self.records:
            if record.outcome is Outcome.PENDING:
                record.outcome, record.detail = Outcome.LOST, "still running when the drill ended"
                record.timed_out = True

    # ------------------------------------------------------------------ one request

    async def _send(self, record: RequestRecord, prompt: str) -> None:
        record.prompt = prompt
        try:
            async with asyncio.timeout(self.spec.request_timeout_s):
                await self._exchange(record, self._body(record, prompt))
        except TimeoutError:
            record.outcome, record.detail = Outcome.LOST, f"no end within {self.spec.request_timeout_s}s"
            record.timed_out = True
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            record.outcome, record.detail = Outcome.ERROR, f"connection: {type(exc).__name__}: {exc}"
            record.error_source = "connection"
        except httpx.TimeoutException as exc:
            record.outcome, record.detail = Outcome.LOST, f"timeout: {type(exc).__name__}"
            record.timed_out = True
        except httpx.HTTPError as exc:
            record.outcome, record.detail = Outcome.ERROR, f"{type(exc).__name__}: {exc}"
            record.error_source = "connection"
        except ValueError as exc:  # a body or chunk that is not the JSON the API promises
            record.outcome, record.detail = Outcome.LOST, f"malformed response: {exc}"
        record.ended_at = self.clock()
        if record.outcome is Outcome.OK and record.greedy and record.index >= 0:
            self._compare(record)

    def _compare(self, record: RequestRecord) -> None:
        """A greedy ``ok``: compare its text with the no-fault text (a ``mismatch`` when they differ)."""
        if self.greedy is None:
            return
        expected = self.greedy.expected(record.request_id, record.prompt_id)
        if expected is None:
            return
        want = self.greedy.compared(expected)
        record.compared_chars = len(want)
        if self.greedy.compared(record.text) != want:
            record.outcome = Outcome.MISMATCH
            record.detail = (
                f"greedy text differs from the no-fault text: {record.text[:60]!r}, want {expected[:60]!r}"
            )

    def _complete(self, record: RequestRecord, finish_reason: object, num_tokens: int) -> None:
        record.num_tokens = num_tokens
        if finish_reason == "length" and num_tokens == self.spec.output_tokens:
            record.outcome = Outcome.OK
        else:
            record.outcome = Outcome.LOST
            record.detail = f"truncated without an error: finish_reason={finish_reason}, {num_tokens} tokens"

    async def _exchange(self, record: RequestRecord, body: dict[str, object]) -> None:
        if not record.stream:
            response = await self._http.post("/v1/completions", json=body)
            record.status = response.status_code
            if response.status_code != 200:
                record.outcome = _failed(response.status_code)
                record.detail = f"HTTP {response.status_code}: {_error_message(response.text)}"
                record.error_source = "answer"
                return
            data = response.json()
            record.request_id = str(data.get("id", ""))
            choice = data["choices"][0]
            record.text = choice.get("text", "")
            record.first_token_at = self.clock()
            _usage(record, data.get("usage") or {})
            self._complete(
                record, choice.get("finish_reason"), int(data.get("usage", {}).get("completion_tokens", 0))
            )
            return
        body = {**body, "stream_options": {"include_usage": True}}
        async with self._http.stream("POST", "/v1/completions", json=body) as response:
            record.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                record.outcome = _failed(response.status_code)
                record.detail = f"HTTP {response.status_code}: {_error_message(response.text)}"
                record.error_source = "answer"
                return
            parts: list[str] = []
            finish: object = None
            usage = 0
            done = False
            async for line in _sse_lines(response):
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    record.outcome = Outcome.ERROR
                    record.detail = f"stream error: {_error_message(payload)}"
                    record.error_source = "answer"
                    return
                if not record.request_id and chunk.get("id"):
                    record.request_id = str(chunk["id"])
                if chunk.get("usage"):
                    usage = int(chunk["usage"].get("completion_tokens", 0))
                    _usage(record, chunk["usage"])
                for choice in chunk.get("choices", []):
                    if choice.get("text"):
                        if record.first_token_at is None:
                            record.first_token_at = self.clock()
                        parts.append(choice["text"])
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
            record.text = "".join(parts)
            if not done:
                record.outcome, record.detail = Outcome.ERROR, "the stream broke off (no [DONE])"
                record.error_source = "connection"
                return
            self._complete(record, finish, usage)


async def _sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of an event stream, split at CR LF, LF or CR only, as the SSE format says
    (httpx's ``aiter_lines`` also splits at U+0085, U+2028 and the other Unicode line breaks,
    which a JSON string in a ``data:`` line may hold as they are)."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = _LINE_END.split(pending + text)
        for line in lines:
            yield line
    if pending:
        yield pending


def _usage(record: RequestRecord, usage: dict[str, object]) -> None:
    """The prompt and cached token counts of an answer's ``usage``."""
    prompt = usage.get("prompt_tokens")
    record.prompt_tokens = prompt if isinstance(prompt, int) else None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    record.cached_tokens = cached if isinstance(cached, int) else None


def _failed(status: int) -> Outcome:
    """A client error (4xx but 429) is the request's own fault; the rest a retryable error."""
    return Outcome.REJECTED if 400 <= status < 500 and status != 429 else Outcome.ERROR


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return text[:200]
