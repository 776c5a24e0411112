"""What the HTTP routes share, and the FastAPI dependencies that hand it to them.

:class:`FrontendState` is the one object every route reads: the frozen
config, the tokenizer, the running :class:`~frontend.gateway.Gateway` (with
its metrics), the :class:`~frontend.admission.Admission` counter and the
stored Responses API responses (:class:`~frontend.responses_api.store.ResponseStore`). The app
factory (:mod:`frontend.app`) installs it on ``app.state`` — at once when it
is given a gateway, in the lifespan when it starts its own — and routes take
it, or the part they need, through ``Depends``:

* :data:`StateDep`, :data:`GatewayDep`, :data:`ConfigDep`, :data:`MetricsDep`;
* :func:`require_api_key` (Bearer keys from the config) and
  :func:`priority_of` (the ``priority`` body field or the ``X-Shoal-Priority`` header).

The dependencies are ``async`` on purpose: FastAPI runs plain ``def``
dependencies in a thread pool, a thread hop per request for nothing.
Routes live in :mod:`frontend.routes`; nothing here builds a response.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from starlette.applications import Starlette

from agents.engines.tokenizer import TextTokenizer
from frontend.admission import Admission
from frontend.api_keys import key_matches
from frontend.config import FrontendConfig
from frontend.detokenize import TokenTexts
from frontend.errors import invalid_api_key, invalid_parameter
from frontend.gateway import Gateway
from frontend.metrics import FrontendMetrics
from frontend.responses_api.store import ResponseStore

__all__ = [
    "PRIORITY_HEADER",
    "ConfigDep",
    "FrontendState",
    "GatewayDep",
    "MetricsDep",
    "StateDep",
    "check_api_key",
    "frontend_state",
    "install_state",
    "priority_of",
    "require_api_key",
    "state_of",
]

PRIORITY_HEADER = "x-shoal-priority"
_STATE_ATTRIBUTE = "frontend"


@dataclass(frozen=True)
class FrontendState:
    """Everything the routes of one app share. Built once the gateway exists."""

    config: FrontendConfig
    tokenizer: TextTokenizer
    gateway: Gateway
    admission: Admission
    #: stored Responses API responses, in the bus's ``<prefix>_responses`` bucket
    responses: ResponseStore
    #: the tokenizer's single-token texts, with special tokens skipped and shown, shared by all requests
    token_texts: tuple[TokenTexts, TokenTexts]

    def texts_of(self, *, skip_special_tokens: bool) -> TokenTexts:
        """The single-token texts for detokenizers of this ``skip_special_tokens``."""
        return self.token_texts[0 if skip_special_tokens else 1]

    @classmethod
    def build(cls, config: FrontendConfig, tokenizer: TextTokenizer, gateway: Gateway) -> FrontendState:
        admission = Admission(
            config.max_concurrent_requests, retry_after_s=config.retry_after_s, metrics=gateway.metrics
        )
        responses = ResponseStore(gateway.bus, gateway.subjects.responses_bucket, config.responses_ttl_s,
                                  retry_after_s=config.retry_after_s)
        texts = (TokenTexts(tokenizer, skip_special_tokens=True),
                 TokenTexts(tokenizer, skip_special_tokens=False))
        return cls(
            config=config, tokenizer=tokenizer, gateway=gateway, admission=admission, responses=responses,
            token_texts=texts,
        )


def install_state(app: Starlette, state: FrontendState) -> None:
    setattr(app.state, _STATE_ATTRIBUTE, state)


def state_of(app: Starlette) -> FrontendState:
    """The state an app's factory or lifespan installed."""
    state = getattr(app.state, _STATE_ATTRIBUTE, None)
    if not isinstance(state, FrontendState):
        raise RuntimeError("the frontend has no gateway yet: its lifespan has not started")
    return state


async def frontend_state(request: Request) -> FrontendState:
    return state_of(request.app)


StateDep = Annotated[FrontendState, Depends(frontend_state)]


async def _gateway(state: StateDep) -> Gateway:
    return state.gateway


async def _config(state: StateDep) -> FrontendConfig:
    return state.config


async def _metrics(state: StateDep) -> FrontendMetrics:
    return state.gateway.metrics


GatewayDep = Annotated[Gateway, Depends(_gateway)]
ConfigDep = Annotated[FrontendConfig, Depends(_config)]
MetricsDep = Annotated[FrontendMetrics, Depends(_metrics)]


async def require_api_key(request: Request, config: ConfigDep) -> None:
    """401 unless the request carries one of the configured Bearer keys (none configured: open)."""
    check_api_key(request, config)


def check_api_key(request: Request, config: FrontendConfig) -> None:
    """Raise 401 unless the request carries one of ``config.api_keys`` as a Bearer token."""
    if not config.api_keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key_matches(key.strip(), config.api_keys):
        raise invalid_api_key()


def priority_of(request: Request, body_priority: int | None) -> int:
    """The request's priority: the body's ``priority``, else the header, else 0 (lower runs sooner)."""
    if body_priority is not None:
        return body_priority
    raw = request.headers.get(PRIORITY_HEADER)
    if raw is None:
        return 0
    try:
        return int(raw)
    except ValueError:
        raise invalid_parameter(f"{PRIORITY_HEADER} must be an integer", "priority") from None
