"""ASGI middleware of the frontend: the request-body size limit.

:class:`BodyLimitMiddleware` answers 413 in OpenAI's error format for a body
over ``max_bytes``, by its ``Content-Length`` or, without one, while the body
is read, before the route has sent anything.
"""

from __future__ import annotations

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend.errors import error_body

__all__ = ["BodyLimitMiddleware"]

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
