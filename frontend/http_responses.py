"""The Starlette responses the frontend sends: JSON encoded with msgspec, and a turn's SSE stream.

The bodies themselves (OpenAI chunks, responses, errors) are plain dicts
built in :mod:`frontend.responses` and :mod:`frontend.errors`; this module
only wraps them for Starlette.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import msgspec
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = ["SSE_HEADERS", "TurnResponse", "json_response"]

SSE_HEADERS = {"Cache-Control": "no-cache"}
_encode = msgspec.json.Encoder().encode


def json_response(status: int, payload: dict[str, Any], headers: Mapping[str, str] | None = None) -> Response:
    return Response(_encode(payload), status_code=status, media_type="application/json", headers=headers)


class TurnResponse(StreamingResponse):
    """An SSE response that ends its turn even if the client left before the body started.

    (A body generator that never started never runs its ``finally``; ``on_exit``
    must be idempotent with the generator's own accounting.)
    """

    def __init__(self, content: AsyncIterator[bytes], *, on_exit: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_exit = on_exit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_exit()
