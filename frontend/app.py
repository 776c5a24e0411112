"""The OpenAI-compatible HTTP API: a FastAPI app factory over a :class:`~frontend.gateway.Gateway`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as
SSE ending in ``data: [DONE]``, with ``stream_options.include_usage``, or one
JSON body), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus). The frontend tokenizes, detokenizes incrementally (UTF-8 safe),
applies stop strings and counts usage; agents see token ids only. Errors use
OpenAI's format (:mod:`frontend.errors`); oversized bodies get 413; optional
Bearer API keys; more than ``max_concurrent_requests`` in flight get 429 with
``Retry-After``. The priority extension is the ``priority`` body field or the
``X-Shoal-Priority`` header (lower runs sooner).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bus import Bus, BusConfig, JetStreamBus
from frontend import responses as R
from frontend.config import FrontendConfig
from frontend.detokenize import IncrementalDetokenizer, StopStringMatcher
from frontend.errors import (
    APIError,
    context_length_exceeded,
    error_body,
    invalid_api_key,
    invalid_parameter,
    model_not_found,
    overloaded,
)
from frontend.gateway import Gateway, Job, RequestStream
from frontend.metrics import CONTENT_TYPE
from frontend.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    sampling_of,
    stop_strings_of,
    wants_logprobs,
)
from frontend.tokenization import chat_prompt_ids, completion_prompt_ids, load_frontend_tokenizer, token_text
from schemas import CloseReason, FinishReason, Subjects

__all__ = ["PRIORITY_HEADER", "BodyLimitMiddleware", "create_app", "running_gateway"]

PRIORITY_HEADER = "x-shoal-priority"
_encode = msgspec.json.Encoder().encode


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Refuses request bodies over ``max_bytes`` with 413 (by Content-Length, or while reading)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await self._refuse(send)
                    return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = _encode(error_body(
            f"request body exceeds {self.max_bytes} bytes", "invalid_request_error", None, "request_too_large"
        ))
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


class _TurnResponse(StreamingResponse):
    """An SSE response that ends its turn even if the client left before the body started.

    (A body generator that never started never runs its ``finally``; ``on_exit``
    is idempotent with the generator's own accounting.)
    """

    def __init__(self, content: AsyncIterator[bytes], *, on_exit: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_exit = on_exit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_exit()


def _json(status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return Response(_encode(payload), status_code=status, media_type="application/json", headers=headers)


@dataclass
class _Turn:
    """One request in progress at the HTTP layer: text state, counts, and how it ends."""

    stream: RequestStream
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    want_logprobs: bool
    num_prompt_tokens: int
    num_output_tokens: int = 0
    finish_reason: FinishReason | None = None
    ended: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class _Piece:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason | None


async def _pieces(turn: _Turn) -> AsyncIterator[_Piece]:
    """Text pieces of a turn, stop strings applied; the last piece carries the finish reason."""
    while True:
        chunk = await turn.stream.next_chunk()
        if chunk is None:
            reason = turn.stream.finish_reason or FinishReason.STOP
            tail = turn.stops.push(turn.detokenizer.flush())[0] + turn.stops.flush()
            turn.finish_reason = reason
            yield _Piece(tail, (), (), reason)
            return
        tokens = chunk.token_ids
        turn.num_output_tokens += len(tokens)
        logprobs = chunk.logprobs or ()
        if turn.want_logprobs:
            turn.token_ids.extend(tokens)
            turn.logprobs.extend(logprobs)
        text = turn.detokenizer.push(tokens)
        if chunk.finish_reason is not None:
            text += turn.detokenizer.flush()
        safe, stopped = turn.stops.push(text)
        if stopped:
            turn.finish_reason = FinishReason.STOP
            yield _Piece(safe, tokens, logprobs, FinishReason.STOP)
            return
        if chunk.finish_reason is not None:
            safe += turn.stops.flush()
            turn.finish_reason = chunk.finish_reason
            yield _Piece(safe, tokens, logprobs, chunk.finish_reason)
            return
        if safe or (turn.want_logprobs and tokens):
            yield _Piece(safe, tokens, logprobs, None)


def create_app(
    config: FrontendConfig,
    *,
    gateway: Gateway | None = None,
    bus_factory: Callable[[BusConfig], Bus] = JetStreamBus,
) -> FastAPI:
    """The frontend app. Without ``gateway`` its lifespan connects to ``config.nats_url`` and runs one."""
    tokenizer = load_frontend_tokenizer(config.model)
    state: dict[str, Gateway] = {} if gateway is None else {"gateway": gateway}
    in_flight = 0

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if gateway is not None:
            state["gateway"] = gateway
            yield
            return
        bus = bus_factory(BusConfig(url=config.nats_url, subjects=Subjects(config.prefix), name="frontend"))
        await bus.connect()
        own = Gateway(bus, config)
        await own.start()
        state["gateway"] = own
        try:
            yield
        finally:
            await own.stop()
            await bus.close()

    app = FastAPI(title="shoal", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)

    def gw() -> Gateway:
        return state["gateway"]

    # -- errors ---------------------------------------------------------------
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> Response:
        return _json(exc.status, exc.body(), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return _json(400, error_body("The request body is not valid JSON.", "invalid_request_error",
                                         None, "invalid_json"))
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
            for e in errors[:5]
        )
        return _json(400, error_body(message, "invalid_request_error", param, "invalid_parameter"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _json(exc.status_code, error_body(str(exc.detail), "invalid_request_error", None, code),
                     dict(exc.headers or {}))

    # -- helpers --------------------------------------------------------------
    def authorize(request: Request) -> None:
        if not config.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in config.api_keys:
            raise invalid_api_key()

    def priority_of(request: Request, body_priority: int | None) -> int:
        if body_priority is not None:
            return body_priority
        raw = request.headers.get(PRIORITY_HEADER)
        if raw is None:
            return 0
        try:
            return int(raw)
        except ValueError:
            raise invalid_parameter(f"{PRIORITY_HEADER} must be an integer", "priority") from None

    def output_budget(num_prompt: int, requested: int | None, param: str) -> int:
        max_len = gw().max_model_len()
        if num_prompt >= max_len:
            raise context_length_exceeded(
                f"This model's maximum context length is {max_len} tokens; the prompt has {num_prompt}.",
            )
        room = max_len - num_prompt
        if requested is None:
            budget = room if config.default_max_tokens is None else min(room, config.default_max_tokens)
        else:
            if requested > room:
                raise context_length_exceeded(
                    f"This model's maximum context length is {max_len} tokens; the prompt has "
                    f"{num_prompt} and {param} is {requested}.", param=param,
                )
            budget = requested
        if config.max_tokens_cap is not None:
            budget = min(budget, config.max_tokens_cap)
        return max(budget, 1)

    async def start_turn(
        request: Request, body: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
        requested: int | None, param: str, prefix: str,
    ) -> tuple[_Turn, str]:
        nonlocal in_flight
        max_tokens = output_budget(len(prompt_ids), requested, param)
        sampling = sampling_of(body, max_tokens=max_tokens)
        stops = stop_strings_of(body, config.max_stop_strings)
        priority = priority_of(request, body.priority)
        if in_flight >= config.max_concurrent_requests:
            gw().metrics.rejected.labels(status="429").inc()
            raise overloaded(config.retry_after_s)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        deadline = None if config.request_deadline is None else time.monotonic() + config.request_deadline
        job = Job(request_id=request_id, prompt_ids=tuple(prompt_ids), sampling=sampling,
                  priority=priority, deadline=deadline)
        in_flight += 1
        gw().metrics.in_flight.set(in_flight)
        try:
            stream = await gw().open(job)
        except BaseException:
            in_flight -= 1
            gw().metrics.in_flight.set(in_flight)
            raise
        turn = _Turn(
            stream=stream, detokenizer=IncrementalDetokenizer(tokenizer, prompt_ids),
            stops=StopStringMatcher(stops), want_logprobs=wants_logprobs(body),
            num_prompt_tokens=len(prompt_ids),
        )
        return turn, request_id

    def end_turn(turn: _Turn, endpoint: str, outcome: str) -> None:
        """Account for the end of a turn and close its stream (aborting it unless finished). Idempotent."""
        nonlocal in_flight
        if turn.ended:
            return
        turn.ended = True
        in_flight -= 1
        g = gw()
        g.metrics.in_flight.set(in_flight)
        g.metrics.requests.labels(endpoint=endpoint, outcome=outcome).inc()
        if outcome == "ok":
            g.metrics.prompt_tokens.inc(turn.num_prompt_tokens)
            g.metrics.output_tokens.inc(turn.num_output_tokens)
        stopped_early = turn.finish_reason is FinishReason.STOP
        reason = CloseReason.FINISHED if outcome == "ok" and not stopped_early else (
            CloseReason.STOP_STRING if outcome == "ok" else CloseReason.CLIENT
        )
        if turn.stream.assembler.finished and outcome == "ok":
            reason = CloseReason.FINISHED
        g.fire_and_forget(turn.stream.close(reason), "close")

    def check_model(model: str) -> None:
        if model not in config.model_names:
            raise model_not_found(model)

    def decode_one(token_id: int) -> str:
        return token_text(tokenizer, token_id)

    async def collect(request: Request, turn: _Turn) -> tuple[str, list[int], list[float]]:
        """Run a non-streaming turn to its end; a client that goes away aborts it."""
        parts: list[str] = []

        async def drain() -> None:
            async for piece in _pieces(turn):
                parts.append(piece.text)

        task = asyncio.ensure_future(drain())
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if not done and await request.is_disconnected():
                    task.cancel()
                    break
            await task
        except asyncio.CancelledError:
            task.cancel()
            raise
        return "".join(parts), turn.token_ids, turn.logprobs

    def stream_body(
        turn: _Turn, endpoint: str, make_chunk: Callable[[_Piece, bool], dict[str, Any] | None],
        include_usage: bool, first: bytes | None,
    ) -> AsyncIterator[bytes]:
        async def body() -> AsyncIterator[bytes]:
            outcome = "client"
            try:
                if first is not None:
                    yield first
                async for piece in _pieces(turn):
                    chunk = make_chunk(piece, piece.finish_reason is not None)
                    if chunk is not None:
                        yield R.sse(chunk)
                outcome = "ok"
            except APIError as exc:
                outcome = "error"
                yield R.sse(exc.body())
            finally:
                end_turn(turn, endpoint, outcome)
            if include_usage:
                yield R.sse(usage_chunk(turn))
            yield R.DONE

        usage_chunk = usage_chunks[endpoint]
        return body()

    created_now: Callable[[], int] = lambda: int(time.time())  # noqa: E731

    def completion_usage_chunk(turn: _Turn) -> dict[str, Any]:
        return {"id": turn.stream.request_id, "object": "text_completion", "created": created_now(),
                "model": config.model_name, "choices": [],
                "usage": R.usage(turn.num_prompt_tokens, turn.num_output_tokens)}

    def chat_usage_chunk(turn: _Turn) -> dict[str, Any]:
        return {"id": turn.stream.request_id, "object": "chat.completion.chunk", "created": created_now(),
                "model": config.model_name, "choices": [],
                "usage": R.usage(turn.num_prompt_tokens, turn.num_output_tokens)}

    usage_chunks: dict[str, Callable[[_Turn], dict[str, Any]]] = {
        "completions": completion_usage_chunk, "chat": chat_usage_chunk,
    }

    # -- routes ---------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        g = gw()
        live = g.board.live_instance_ids(g.clock())
        return _json(200, {"status": "ok", "instances": live})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gw().metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request)
        created = int(time.time())
        data = [{"id": name, "object": "model", "created": created, "owned_by": "shoal",
                 "max_model_len": gw().max_model_len()} for name in config.model_names]
        return _json(200, {"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        authorize(request)
        check_model(body.model)
        prompt_ids = completion_prompt_ids(tokenizer, body.prompt)
        turn, request_id = await start_turn(request, body, prompt_ids, body.max_tokens, "max_tokens", "cmpl")
        created = int(time.time())
        model = config.model_name
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            text_offset = 0

            def make_chunk(piece: _Piece, last: bool) -> dict[str, Any] | None:
                nonlocal text_offset
                logprobs = None
                if turn.want_logprobs and piece.token_ids and piece.logprobs:
                    logprobs = R.completion_logprobs(piece.token_ids, _pad(piece), decode_one, text_offset)
                text_offset += len(piece.text)
                return R.completion_chunk(request_id, created, model, piece.text, piece.finish_reason,
                                          logprobs, with_usage_field=include_usage)

            return _TurnResponse(
                stream_body(turn, "completions", make_chunk, include_usage, None),
                on_exit=lambda: end_turn(turn, "completions", "client"),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
            )
        outcome = "client"
        try:
            text, token_ids, logprobs = await collect(request, turn)
            outcome = "ok"
        finally:
            end_turn(turn, "completions", outcome)
        lp = R.completion_logprobs(token_ids, _pad_all(token_ids, logprobs), decode_one, 0) \
            if turn.want_logprobs and logprobs else None
        return _json(200, R.completion_response(
            request_id, created, model, text, turn.finish_reason or FinishReason.STOP, turn.num_prompt_tokens,
            turn.num_output_tokens, lp,
        ))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        authorize(request)
        check_model(body.model)
        prompt_ids = chat_prompt_ids(
            tokenizer, body.messages, add_generation_prompt=body.add_generation_prompt is not False
        )
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        turn, request_id = await start_turn(request, body, prompt_ids, requested, param, "chatcmpl")
        created = int(time.time())
        model = config.model_name
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            first = R.sse(R.chat_chunk(request_id, created, model, {"role": "assistant", "content": ""},
                                       None, with_usage_field=include_usage))

            def make_chunk(piece: _Piece, last: bool) -> dict[str, Any] | None:
                logprobs = None
                if turn.want_logprobs and piece.token_ids and piece.logprobs:
                    logprobs = R.chat_logprobs(piece.token_ids, _pad(piece), decode_one)
                delta = {"content": piece.text} if piece.text or not last else {}
                return R.chat_chunk(request_id, created, model, delta, piece.finish_reason, logprobs,
                                    with_usage_field=include_usage)

            return _TurnResponse(
                stream_body(turn, "chat", make_chunk, include_usage, first),
                on_exit=lambda: end_turn(turn, "chat", "client"),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
            )
        outcome = "client"
        try:
            text, token_ids, logprobs = await collect(request, turn)
            outcome = "ok"
        finally:
            end_turn(turn, "chat", outcome)
        lp = R.chat_logprobs(token_ids, _pad_all(token_ids, logprobs), decode_one) \
            if turn.want_logprobs and logprobs else None
        return _json(200, R.chat_response(
            request_id, created, model, text, turn.finish_reason or FinishReason.STOP, turn.num_prompt_tokens,
            turn.num_output_tokens, lp,
        ))

    app.state.gateway = state
    return app


def _pad(piece: _Piece) -> tuple[float, ...]:
    return _pad_all(piece.token_ids, piece.logprobs)


def _pad_all(token_ids: Any, logprobs: Any) -> tuple[float, ...]:
    """Logprobs aligned with tokens (only called when the engine gave them; a short tail pads 0.0)."""
    values = tuple(logprobs)[: len(token_ids)]
    return values + (0.0,) * (len(token_ids) - len(values))


def running_gateway(app: FastAPI) -> Gateway:
    """The gateway an app's lifespan started (for tests and the CLI)."""
    return app.state.gateway["gateway"]  # type: ignore[no-any-return]

