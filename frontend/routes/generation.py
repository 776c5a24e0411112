"""``POST /v1/completions`` and ``POST /v1/chat/completions``: two thin routes over one path.

:func:`generate` is everything the two endpoints share, in order: the API key
(checked after the body validated, as it always was), the model name, the
prompt (the endpoint's :class:`~frontend.flavors.Flavor` builds it), the
output budget against the context length, sampling parameters and stop
strings, the priority, admission (429 with ``Retry-After`` past
``max_concurrent_requests``), then dispatch through the gateway (which emits
the lifecycle events, and answers 503 when no instance takes the request, at
once for a new one, after the rescue timeout for one whose instance failed).
Each choice (``n`` per prompt; completions may carry several prompts) is a
request of its own, a :class:`~frontend.turns.Turn`: admitted, placed,
streamed and ended on its own, all of them or none.
The answer is an SSE stream of the flavor's chunks, each choice's as they come
with its ``index`` (ending in ``data: [DONE]``, with a usage chunk when
asked) or one JSON body; either way the text comes from
:func:`frontend.turns.pieces` (incremental detokenization, stop strings) and
:func:`end_turn` does each turn's accounting exactly once: admission slot,
request and token metrics, closing (or aborting) the stream. A client that
goes away aborts its requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from bus.event_loop import cancel_and_wait
from frontend import responses as R
from frontend.chat_tools import ChatTools
from frontend.config import FrontendConfig
from frontend.dependencies import FrontendState, StateDep, check_api_key, priority_of
from frontend.detokenize import IncrementalDetokenizer, StopStringMatcher
from frontend.errors import APIError, context_length_exceeded, invalid_parameter, model_not_found
from frontend.flavors import CHAT, COMPLETIONS, BodyT, Flavor, Reply
from frontend.gateway import Chain, Job
from frontend.http_responses import TurnResponse, json_response
from frontend.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    sampling_of,
    stop_strings_of,
    wants_logprobs,
)
from frontend.prompt_logprobs import PromptEcho
from frontend.tokenization import token_text
from frontend.turns import Turn, padded_logprobs, padded_top, pieces
from schemas import CloseReason, FinishReason, SamplingParams, StructuredOutput

__all__ = [
    "chat_completions", "collect", "completions", "end_turn", "generate", "output_budget", "router",
    "start_turn",
]

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest, state: StateDep) -> Response:
    return await generate(request, body, COMPLETIONS, state)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest, state: StateDep) -> Response:
    return await generate(request, body, CHAT, state)


async def generate(request: Request, body: BodyT, flavor: Flavor[BodyT], state: FrontendState) -> Response:
    """Serve one completions or chat request. See the module docstring."""
    config = state.config
    check_api_key(request, config)  # not a Depends: that would run before the body validates (401, not 400)
    if body.model not in config.model_names:
        raise model_not_found(body.model)
    tools = ChatTools.of(body, config.tool_call_parser) if isinstance(body, ChatCompletionRequest) else None
    prompts = flavor.prompts(state.tokenizer, body)
    echo = PromptEcho.of(body, prompts, state.tokenizer)
    turns = await _start_turns(request, body, flavor, prompts, state, tools.structured if tools else None,
                               keep_special_tokens=tools is not None and tools.keeps_special_tokens)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    reply = Reply(turns[0].request_id, int(time.time()), config.model_name, include_usage)
    if body.stream:
        on_exit = functools.partial(_end_turns, state, turns, "client")
        return TurnResponse(_stream(turns, flavor, reply, state, body.n or 1, tools, echo), on_exit=on_exit)
    outcome = "client"
    try:
        texts = await asyncio.gather(*(collect(request, turn) for turn in turns))
        outcome = "ok"
    except APIError:  # e.g. 503: its instance failed and none took it within the rescue timeout
        outcome = "error"
        raise
    finally:
        _end_turns(state, turns, outcome)
    choices = []
    for index, (turn, text) in enumerate(zip(turns, texts, strict=True)):
        logprobs = None
        offset = 0 if echo is None else len(echo.text(index))
        if turn.want_logprobs and turn.logprobs:
            aligned = padded_logprobs(turn.token_ids, turn.logprobs)
            top = padded_top(turn.token_ids, turn.top_logprobs)
            logprobs = flavor.logprobs(turn.token_ids, aligned, top, _decoder(state), offset)
        if echo is not None:  # the prompt's text and logprobs first
            text = echo.completion_text(index, text)
            logprobs = echo.completion_logprobs(turn, _decoder(state), logprobs)
        finish_reason = turn.finish_reason or FinishReason.STOP
        if tools is not None:  # content and tool calls
            choices.append(tools.message(index, text, finish_reason, logprobs))
        else:
            choices.append(flavor.choice(index, text, finish_reason, logprobs))
        if echo is not None and flavor is COMPLETIONS and echo.field is not None:
            choices[-1]["prompt_logprobs"] = echo.field_value(turn, _decoder(state))
    body_json = flavor.response(reply, choices, *_usage(turns, body.n or 1))
    if echo is not None and flavor is not COMPLETIONS and echo.field is not None:
        body_json["prompt_logprobs"] = echo.field_value(turns[0], _decoder(state))  # vLLM's chat shape
    return json_response(200, body_json)


def output_budget(config: FrontendConfig, max_model_len: int, num_prompt: int, requested: int | None,
                  param: str) -> int:
    """How many tokens the request may generate; 400 ``context_length_exceeded`` if it cannot fit."""
    if num_prompt >= max_model_len:
        raise context_length_exceeded(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {num_prompt}.",
        )
    room = max_model_len - num_prompt
    if requested is None:
        budget = room if config.default_max_tokens is None else min(room, config.default_max_tokens)
    else:
        if requested > room:
            raise context_length_exceeded(
                f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{num_prompt} and {param} is {requested}.", param=param,
            )
        budget = requested
    if config.max_tokens_cap is not None:
        budget = min(budget, config.max_tokens_cap)
    return budget if requested == 0 else max(budget, 1)  # 0: the prompt only (echo)


async def _start_turns(
    request: Request, body: BodyT, flavor: Flavor[BodyT], prompts: list[list[int]], state: FrontendState,
    structured: StructuredOutput | None = None, *, keep_special_tokens: bool = False,
) -> list[Turn]:
    """Validate what is left, admit and place every choice: ``n`` per prompt, prompt by prompt (choice
    ``p * n + i`` is prompt ``p``'s ``i``-th). Each is a request of its own; the ``i``-th of a seeded
    request samples with ``seed + i``, as vLLM's. They are placed all at once (a batch of prompts
    reaches the engines together, not one dispatch round trip after another). Their streams are
    open on return, or none is: a choice that cannot be placed ends the others."""
    config, gateway = state.config, state.gateway
    n = body.n or 1
    if len(prompts) * n > config.max_concurrent_requests:
        raise invalid_parameter(
            f"{len(prompts)} prompts x n = {n} is {len(prompts) * n} requests; this server takes at most "
            f"{config.max_concurrent_requests} at once", "n" if len(prompts) == 1 else "prompt",
        )
    requested, param = flavor.requested_max_tokens(body)
    max_model_len = gateway.max_model_len()
    budgets = [output_budget(config, max_model_len, len(ids), requested, param) for ids in prompts]
    stops = stop_strings_of(body, config.max_stop_strings)
    priority = priority_of(request, body.priority)
    jobs: list[tuple[list[int], SamplingParams, Chain]] = []
    for prompt_ids, max_tokens in zip(prompts, budgets, strict=True):
        sampling = sampling_of(body, max_tokens=max_tokens, vocab_size=state.tokenizer.vocab_size,
                               structured=structured)
        chain = gateway.prompt_chain(prompt_ids)  # once per prompt, for all its choices
        for index in range(n):
            seed = None if sampling.seed is None else (sampling.seed + index) % (2**63)
            choice_sampling = msgspec.structs.replace(sampling, seed=seed) if index else sampling
            jobs.append((prompt_ids, choice_sampling, chain))
    start = functools.partial(_start_turn, keep_special_tokens=keep_special_tokens)
    if len(jobs) == 1:
        ids, sampling, chain = jobs[0]
        return [await start(request, body, flavor, ids, state, sampling, stops, priority, chain)]
    tasks = [
        asyncio.ensure_future(start(request, body, flavor, ids, state, sampling, stops, priority, chain))
        for ids, sampling, chain in jobs
    ]
    try:
        await asyncio.wait(tasks)
    except BaseException:  # the client went away while they were placed: what gets placed ends
        for task in tasks:
            task.cancel()
            task.add_done_callback(functools.partial(_end_placed, state))
        raise
    failures = [error for task in tasks if (error := task.exception()) is not None]
    turns = [task.result() for task in tasks if task.exception() is None]
    if failures:
        _end_turns(state, turns, "client")
        raise failures[0]
    return turns


def _end_placed(state: FrontendState, task: asyncio.Future[Turn]) -> None:
    if not task.cancelled() and task.exception() is None:
        end_turn(state, task.result(), "client")


def _usage(turns: list[Turn], n: int) -> tuple[int, int, int]:
    """Prompt tokens (each prompt once, however many choices it has), output tokens (every choice)
    and cached prompt tokens (each prompt's first choice's: what its first instance found cached)."""
    firsts = turns[::n]
    return (sum(turn.num_prompt_tokens for turn in firsts), sum(turn.num_output_tokens for turn in turns),
            sum(turn.stream.num_cached_tokens or 0 for turn in firsts))


async def _start_turn(
    request: Request, body: BodyT, flavor: Flavor[BodyT], prompt_ids: list[int], state: FrontendState,
    sampling: SamplingParams, stops: tuple[str, ...], priority: int, chain: Chain, *,
    keep_special_tokens: bool = False,
) -> Turn:
    """Admit and place one choice (``chain``: its prompt's block-hash chain); its stream is open on return."""
    return await start_turn(
        state, prompt_ids, sampling, request_id=f"{flavor.id_prefix}-{uuid.uuid4().hex}",
        endpoint=flavor.endpoint, stops=stops, priority=priority, want_logprobs=wants_logprobs(body),
        chain=chain, keep_special_tokens=keep_special_tokens,
    )


async def start_turn(
    state: FrontendState, prompt_ids: list[int], sampling: SamplingParams, *, request_id: str, endpoint: str,
    stops: tuple[str, ...] = (), priority: int = 0, want_logprobs: bool = False, chain: Chain | None = None,
    keep_special_tokens: bool = False,
) -> Turn:
    """Admit and place one request of ``endpoint`` (its metrics label); its stream is open on return.
    ``chain``: its prompt's block-hash chain (None: computed here). ``keep_special_tokens``: the text
    shows special tokens but the end-of-sequence ones (for a tool call parser that needs them, as vLLM's
    ``skip_special_tokens: false``). End it with :func:`end_turn`."""
    config, gateway = state.config, state.gateway
    state.admission.admit()
    try:
        deadline = None if config.request_deadline is None else time.monotonic() + config.request_deadline
        job = Job(request_id=request_id, prompt_ids=tuple(prompt_ids), sampling=sampling, priority=priority,
                  deadline=deadline, chain=gateway.prompt_chain(prompt_ids) if chain is None else chain)
        stream = await gateway.open(job)
    except BaseException:
        state.admission.release()
        raise
    return Turn(
        stream=stream, endpoint=endpoint,
        detokenizer=IncrementalDetokenizer(
            state.tokenizer, prompt_ids, skip_special_tokens=not keep_special_tokens,
            hidden_ids=state.tokenizer.eos_token_ids if keep_special_tokens else (),
            token_texts=state.texts_of(skip_special_tokens=not keep_special_tokens),
        ),
        stops=StopStringMatcher(stops),
        want_logprobs=want_logprobs, num_prompt_tokens=len(prompt_ids),
    )


def _end_turns(state: FrontendState, turns: list[Turn], outcome: str) -> None:
    for turn in turns:
        end_turn(state, turn, outcome)


def end_turn(state: FrontendState, turn: Turn, outcome: str) -> None:
    """Account for the end of a turn and close its stream (aborting it unless finished). Idempotent."""
    if turn.ended:
        return
    turn.ended = True
    state.admission.release()
    gateway = state.gateway
    metrics = gateway.metrics
    metrics.requests.labels(endpoint=turn.endpoint, outcome=outcome).inc()
    if outcome == "ok":
        metrics.prompt_tokens.inc(turn.num_prompt_tokens)
        metrics.output_tokens.inc(turn.num_output_tokens)
        metrics.cached_prompt_tokens.inc(turn.stream.num_cached_tokens or 0)
    stopped_early = turn.finish_reason is FinishReason.STOP
    reason = CloseReason.FINISHED if outcome == "ok" and not stopped_early else (
        CloseReason.STOP_STRING if outcome == "ok" else CloseReason.CLIENT
    )
    if turn.stream.assembler.finished and outcome == "ok":
        reason = CloseReason.FINISHED
    gateway.fire_and_forget(turn.stream.close(reason), "close")


def _decoder(state: FrontendState) -> Callable[[int], str]:
    return functools.partial(token_text, state.tokenizer)


async def _stream(
    turns: list[Turn], flavor: Flavor[BodyT], reply: Reply, state: FrontendState, n: int,
    tools: ChatTools | None = None, echo: PromptEcho | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body of a streaming request, its choices' chunks as they come (each with its index);
    an error after the stream started is sent as a chunk."""
    outcome = "client"
    try:
        for index in range(len(turns)):
            first = flavor.first_chunk(reply, index)
            if first is not None:
                yield R.sse(first)
        if len(turns) == 1:
            async for chunk in _chunks(turns[0], 0, flavor, reply, state, tools, echo):
                yield chunk
        else:
            choices = [_chunks(turn, i, flavor, reply, state, tools, echo) for i, turn in enumerate(turns)]
            async for chunk in _merged(choices):
                yield chunk
        outcome = "ok"
    except APIError as exc:
        outcome = "error"
        yield R.sse(exc.body())
    finally:
        _end_turns(state, turns, outcome)
    if reply.include_usage:
        yield R.sse(R.usage_chunk(reply.request_id, flavor.chunk_object, int(time.time()), reply.model,
                                  *_usage(turns, n)))
    yield R.DONE


async def _chunks(
    turn: Turn, index: int, flavor: Flavor[BodyT], reply: Reply, state: FrontendState,
    tools: ChatTools | None = None, echo: PromptEcho | None = None,
) -> AsyncIterator[bytes]:
    """One choice's SSE chunks (with ``tools``: content and tool call deltas as its parser releases them;
    with ``echo``: the first carries the prompt's text and logprobs before its own)."""
    decode_one = _decoder(state)
    text_offset = 0
    tool_chunks = tools.chunks() if tools is not None else None
    echoing = echo is not None and echo.texts is not None
    async for piece in pieces(turn):
        if echoing and echo is not None:
            text_offset = len(echo.text(index))
        logprobs = None
        if turn.want_logprobs and piece.token_ids and piece.logprobs:
            aligned = padded_logprobs(piece.token_ids, piece.logprobs)
            top = padded_top(piece.token_ids, piece.top_logprobs)
            logprobs = flavor.logprobs(piece.token_ids, aligned, top, decode_one, text_offset)
        if echoing and echo is not None:  # the first chunk: the prompt, then this piece
            echoing = False
            logprobs = echo.completion_logprobs(turn, decode_one, logprobs)
            piece = dataclasses.replace(piece, text=echo.completion_text(index, piece.text))
            text_offset = 0
        text_offset += len(piece.text)
        if tool_chunks is None:
            yield R.sse(flavor.chunk(reply, piece, logprobs, index))
        elif (chunk := tool_chunks.chunk(reply.request_id, reply.created, reply.model, piece, logprobs,
                                         index=index, with_usage_field=reply.include_usage)) is not None:
            yield R.sse(chunk)


async def _merged(sources: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The items of several async iterators as each comes; the first error ends them all."""
    queue: asyncio.Queue[tuple[bytes | None, BaseException | None]] = asyncio.Queue()

    async def pump(source: AsyncIterator[bytes]) -> None:
        try:
            async for item in source:
                await queue.put((item, None))
        except Exception as exc:
            await queue.put((None, exc))
            return
        await queue.put((None, None))

    tasks = [asyncio.ensure_future(pump(source)) for source in sources]
    try:
        running = len(tasks)
        while running:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                running -= 1
            else:
                yield item
    finally:
        await cancel_and_wait(tasks)


async def collect(request: Request, turn: Turn) -> str:
    """Run a non-streaming turn to its end and return its text; a client that goes away aborts it."""
    parts: list[str] = []
    task = asyncio.ensure_future(_drain(turn, parts))
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
    return "".join(parts)


async def _drain(turn: Turn, parts: list[str]) -> None:
    async for piece in pieces(turn):
        parts.append(piece.text)
