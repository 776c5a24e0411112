"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

Thin routes over :mod:`frontend.responses_api`: creating a response runs it through the chat
path (:func:`frontend.responses_api.serve.create`); retrieving and deleting read the stored
responses (:class:`~frontend.responses_api.store.ResponseStore`, any frontend's), as does listing a
response's input items (``GET /v1/responses/{id}/input_items``, paged as OpenAI pages them). An unknown,
deleted or expired id is a 404 as OpenAI answers; an unreachable store a 503.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from frontend.dependencies import StateDep, check_api_key
from frontend.errors import APIError
from frontend.http_responses import json_response
from frontend.responses_api import serve
from frontend.responses_api.models import ResponsesRequest
from frontend.responses_api.objects import item_page

__all__ = ["create_response", "delete_response", "list_input_items", "retrieve_response", "router"]

router = APIRouter()


def _not_found(response_id: str) -> APIError:
    return APIError(
        404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found"
    )


@router.post("/v1/responses")
async def create_response(request: Request, body: ResponsesRequest, state: StateDep) -> Response:
    return await serve.create(request, body, state)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: str, state: StateDep) -> Response:
    check_api_key(request, state.config)
    stored = await state.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return json_response(200, stored.response)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    request: Request,
    response_id: str,
    state: StateDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> Response:
    check_api_key(request, state.config)
    stored = await state.responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return json_response(200, item_page(stored.input_items(), after=after, limit=limit, order=order))


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str, state: StateDep) -> Response:
    check_api_key(request, state.config)
    if not await state.responses.delete(response_id):
        raise _not_found(response_id)
    return json_response(200, {"id": response_id, "object": "response.deleted", "deleted": True})
