"""The OpenAI-compatible HTTP app: :func:`create_app` assembles it over a :class:`~frontend.gateway.Gateway`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as
SSE ending in ``data: [DONE]``, with ``stream_options.include_usage``, or one
JSON body), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus); they live in :mod:`frontend.routes`, and what they share
(:class:`~frontend.dependencies.FrontendState`) is installed on ``app.state``
here — at once when a gateway is given, else by :class:`FrontendLifespan`,
which connects to NATS and runs one. This module holds the assembly only:
the lifespan, the body-size middleware (:mod:`frontend.middleware`: 413) and
the handlers that put every error in OpenAI's format (:mod:`frontend.errors`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from opentelemetry.sdk.trace import TracerProvider
from starlette.exceptions import HTTPException as StarletteHTTPException

from agents.engines.tokenizer import TextTokenizer
from bus import Bus, BusConfig, JetStreamBus, StreamConfig
from bus.heap import freeze_startup_heap
from bus.metrics import BusCollector
from frontend.config import FrontendConfig
from frontend.dependencies import PRIORITY_HEADER, FrontendState, install_state, state_of
from frontend.errors import APIError, error_body
from frontend.gateway import Gateway
from frontend.http_responses import json_response
from frontend.middleware import BodyLimitMiddleware
from frontend.routes import ROUTERS
from frontend.tokenization import load_frontend_tokenizer
from frontend.tracing import TracingMiddleware
from schemas import Subjects

__all__ = ["PRIORITY_HEADER", "BodyLimitMiddleware", "FrontendLifespan", "create_app", "running_gateway"]


def create_app(
    config: FrontendConfig,
    *,
    gateway: Gateway | None = None,
    bus_factory: Callable[[BusConfig], Bus] = JetStreamBus,
    tracer_provider: TracerProvider | None = None,
    freeze_heap: bool = False,
) -> FastAPI:
    """The frontend app. Without ``gateway`` its lifespan connects to ``config.nats_url`` and runs one.

    With ``tracer_provider`` every HTTP request gets a server span (:mod:`frontend.tracing`). With
    ``freeze_heap`` (``shoal serve``) the lifespan freezes the start-up heap once the gateway runs
    (:func:`bus.heap.freeze_startup_heap`).
    """
    tokenizer = load_frontend_tokenizer(config.model)
    app = FastAPI(
        title="shoal", version="0.1.0",
        lifespan=FrontendLifespan(config, tokenizer, gateway=gateway, bus_factory=bus_factory,
                                  freeze_heap=freeze_heap),
        exception_handlers={
            APIError: on_api_error,
            RequestValidationError: on_validation_error,
            StarletteHTTPException: on_http_error,
        },
    )
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    if tracer_provider is not None:  # outermost: the span covers the 413 answers too
        app.add_middleware(TracingMiddleware, tracer_provider=tracer_provider)
    for router in ROUTERS:
        app.include_router(router)
    if gateway is not None:  # served without a lifespan too (tests: ASGI transport, lifespan="off")
        install_state(app, FrontendState.build(config, tokenizer, gateway))
    return app


def running_gateway(app: FastAPI) -> Gateway:
    """The gateway an app was given or its lifespan started (for tests and the CLI)."""
    return state_of(app).gateway


@dataclass(frozen=True)
class FrontendLifespan:
    """The app's lifespan: with a given gateway nothing to do; else connect, run a gateway, stop it."""

    config: FrontendConfig
    tokenizer: TextTokenizer
    gateway: Gateway | None = None
    bus_factory: Callable[[BusConfig], Bus] = JetStreamBus
    freeze_heap: bool = False

    @asynccontextmanager
    async def __call__(self, app: FastAPI) -> AsyncIterator[None]:
        if self.gateway is not None:
            yield
            return
        config = self.config
        subjects = Subjects(config.prefix)
        bus = self.bus_factory(BusConfig(
            url=config.nats_url, auth=config.nats_auth, subjects=subjects,
            streams=StreamConfig(replicas=config.nats_replicas), name="frontend",
        ))
        await bus.connect()
        gateway = Gateway(bus, config)
        counted = bus if isinstance(bus, JetStreamBus) else None
        gateway.metrics.registry.register(BusCollector(lambda: counted))
        await gateway.start()
        install_state(app, FrontendState.build(config, self.tokenizer, gateway))
        if self.freeze_heap:
            freeze_startup_heap()
        try:
            yield
        finally:
            await gateway.stop()
            await bus.close()


# -- errors, all in OpenAI's format ------------------------------------------------------------

async def on_api_error(request: Request, exc: APIError) -> Response:
    return json_response(exc.status, exc.body(), exc.headers)


async def on_validation_error(request: Request, exc: RequestValidationError) -> Response:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return json_response(400, error_body("The request body is not valid JSON.", "invalid_request_error",
                                             None, "invalid_json"))
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
        for e in errors[:5]
    )
    return json_response(400, error_body(message, "invalid_request_error", param, "invalid_parameter"))


async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return json_response(exc.status_code, error_body(str(exc.detail), "invalid_request_error", None, code),
                         dict(exc.headers or {}))
