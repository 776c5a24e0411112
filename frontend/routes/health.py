"""``GET /health`` (can this frontend place a request now?) and ``GET /metrics`` (Prometheus text).

``/health`` answers from the load board (:meth:`frontend.board.LoadBoard.readiness`):
200 ``{"status": "ok", ...}`` while at least one instance is *ready* (joined,
reported load, heard from lately, neither terminating nor failed: a request
would be placed on it), else 503 ``{"status": "unavailable", "reason": ...}``
— before the first agent reports and after the last one died or left. Either
way the body lists the ready instances' ids (``instances``) and every known
instance's state (``states``: joined / ready / silent / terminating / failed),
so it serves as the readiness view too. Neither route needs the API key: load
balancers, ``shoal up`` and Prometheus poll them.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from frontend.board import LoadBoard
from frontend.dependencies import GatewayDep, MetricsDep
from frontend.http_responses import json_response
from frontend.metrics import CONTENT_TYPE

__all__ = ["health", "health_body", "metrics", "router"]

router = APIRouter()

NO_INSTANCE_KNOWN = "no instance has joined"
NO_INSTANCE_READY = "no instance ready"


def health_body(board: LoadBoard, now: float) -> tuple[int, dict[str, Any]]:
    """The status code and body of ``/health`` for ``board`` at ``now``."""
    states = board.readiness_view(now)
    ready = board.ready_instance_ids(now)
    body: dict[str, Any] = {
        "status": "ok", "instances": ready, "states": {i: str(s) for i, s in states.items()},
    }
    if ready:
        return 200, body
    reason = NO_INSTANCE_READY if states else NO_INSTANCE_KNOWN
    return 503, {**body, "status": "unavailable", "reason": reason}


@router.get("/health")
async def health(gateway: GatewayDep) -> Response:
    status, body = health_body(gateway.board, gateway.clock())
    # which process answers: ``shoal up`` checks that it is its own frontend, not another server's
    return json_response(status, {**body, "pid": os.getpid()})


@router.get("/metrics")
async def metrics(metrics: MetricsDep) -> Response:
    return Response(metrics.render(), media_type=CONTENT_TYPE)
