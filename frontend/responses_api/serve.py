"""Running a Responses API request through the chat path, whole or as a typed event stream.

:func:`create` plans the response (:func:`~frontend.responses_api.plan.plan_of`), then runs it as
one request through the same path as chat completions (:func:`~frontend.routes.generation.start_turn`:
admission, placement, bypass and rescue in the gateway; :func:`~frontend.turns.pieces`:
detokenization; :func:`~frontend.routes.generation.end_turn`: accounting), and builds the output
items with :class:`~frontend.responses_api.output.OutputBuilder`. With ``store`` (the default)
the finished response and its conversation go to the store before the client gets it, so a
``previous_response_id`` naming it works on any frontend at once.

A stream sends ``response.created`` and ``response.in_progress``, the output's events as the text
comes, then ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it);
an error after the stream started (its instance failed and none took it over, or the store is
unreachable) is a ``response.failed`` event whose response carries the error.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from frontend.dependencies import FrontendState
from frontend.errors import APIError
from frontend.http_responses import TurnResponse, json_response
from frontend.responses_api.models import ResponsesRequest
from frontend.responses_api.objects import EventStream, Json, usage
from frontend.responses_api.plan import Plan, plan_of
from frontend.responses_api.store import StoredResponse
from frontend.routes.generation import collect, end_turn, start_turn
from frontend.turns import Turn, pieces
from schemas import FinishReason

__all__ = ["ENDPOINT", "create"]

#: the requests metrics' endpoint label
ENDPOINT = "responses"


async def create(request: Request, body: ResponsesRequest, state: FrontendState) -> Response:
    """Serve ``POST /v1/responses``. See the module docstring."""
    plan = await plan_of(request, body, state)
    turn = await start_turn(
        state,
        plan.prompt_ids,
        plan.sampling,
        request_id=plan.response_id,
        endpoint=ENDPOINT,
        priority=plan.priority,
    )
    if body.stream:
        return TurnResponse(
            _events(plan, turn, state), on_exit=functools.partial(end_turn, state, turn, "client")
        )
    outcome = "client"
    try:
        text = await collect(request, turn)
        outcome = "ok"
    except APIError:
        outcome = "error"
        raise
    finally:
        end_turn(state, turn, outcome)
    builder = plan.output_builder()
    builder.feed(text)
    builder.finish(complete=turn.finish_reason is not FinishReason.LENGTH)
    response = _finished(plan, turn, builder.output)
    await _store(state, plan, response)
    return json_response(200, response)


def _finished(plan: Plan, turn: Turn, output: list[Json]) -> Json:
    incomplete = turn.finish_reason is FinishReason.LENGTH
    return plan.response(
        status="incomplete" if incomplete else "completed",
        output=output,
        usage_block=usage(turn.num_prompt_tokens, turn.num_output_tokens, turn.stream.num_cached_tokens or 0),
        incomplete_reason="max_output_tokens" if incomplete else None,
    )


async def _store(state: FrontendState, plan: Plan, response: Json) -> None:
    if plan.store:
        await state.responses.put(
            StoredResponse(response=response, items=plan.items, input_start=plan.input_start)
        )


async def _events(plan: Plan, turn: Turn, state: FrontendState) -> AsyncIterator[bytes]:
    events = EventStream()
    started = plan.response(status="in_progress", output=[])
    yield events.event("response.created", response=started)
    yield events.event("response.in_progress", response=started)
    builder = plan.output_builder(events)
    outcome = "client"
    try:
        async for piece in pieces(turn):
            for event in builder.feed(piece.text):
                yield event
        outcome = "ok"
    except APIError as exc:
        outcome = "error"
        yield _failed(events, plan, builder.output, exc)
        return
    finally:
        end_turn(state, turn, outcome)
    for event in builder.finish(complete=turn.finish_reason is not FinishReason.LENGTH):
        yield event
    response = _finished(plan, turn, builder.output)
    try:
        await _store(state, plan, response)
    except APIError as exc:
        yield _failed(events, plan, builder.output, exc)
        return
    yield events.event(f"response.{response['status']}", response=response)


def _failed(events: EventStream, plan: Plan, output: list[Json], exc: APIError) -> bytes:
    error = {"code": exc.code or "server_error", "message": exc.message}
    return events.event(
        "response.failed", response=plan.response(status="failed", output=output, error=error)
    )
