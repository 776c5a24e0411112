"""The frontend's HTTP routes, one router per module; :mod:`frontend.app` includes them.

* :mod:`frontend.routes.generation` — ``POST /v1/completions``, ``POST /v1/chat/completions``;
* :mod:`frontend.routes.responses` — ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``,
  ``GET /v1/responses/{id}/input_items``;
* :mod:`frontend.routes.models` — ``GET /v1/models``;
* :mod:`frontend.routes.tokenize` — ``POST /tokenize``, ``POST /detokenize`` (vLLM's);
* :mod:`frontend.routes.health` — ``GET /health``, ``GET /metrics``.

Each route is a plain function; what routes share comes through the
dependencies of :mod:`frontend.dependencies`.
"""

from __future__ import annotations

from fastapi import APIRouter

from frontend.routes import generation, health, models, responses, tokenize

__all__ = ["ROUTERS"]

#: In the order the routes were registered before (it is the OpenAPI schema's order).
ROUTERS: tuple[APIRouter, ...] = (
    health.router, models.router, generation.router, tokenize.router, responses.router,
)
