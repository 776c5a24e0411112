"""``GET /health`` (can this frontend place a request now?) and ``GET /metrics`` (Prometheus text).

``/health`` answers from the load board (:meth:`frontend.board.LoadBoard.readiness`):
200 ``{"status": "ok", ...}`` while at least one instance is *ready* (joined,
reported load, heard from lately, neither terminating nor failed: a request
would be placed on it), else 503 ``{"status": "unavailable", "reason": ...}``
— before the first agent reports and after the last one died or left. Either
way the body lists the ready instances' ids (``instances``) and every known
instance's state (``states``: joined / ready / silent / terminating / failed),
so it serves as the readiness view too. Where a supervisor runs the cluster
(``shoal up``, which passes ``--supervisor-status``), the components it left
down after a crash loop are listed with why (``left_down``: name -> reason, the
exit signal and what to try), and a 503's ``reason`` says it too; a frontend
without a supervisor has no such list. Neither route needs the API key: load
balancers, ``shoal up`` and Prometheus poll them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from frontend.board import LoadBoard
from frontend.dependencies import ConfigDep, GatewayDep, MetricsDep
from frontend.http_responses import json_response
from frontend.metrics import CONTENT_TYPE
from frontend.supervisor import read_status

__all__ = ["health", "health_body", "metrics", "router"]

router = APIRouter()

NO_INSTANCE_KNOWN = "no instance has joined"
NO_INSTANCE_READY = "no instance ready"


def health_body(
    board: LoadBoard, now: float, left_down: Mapping[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    """The status code and body of ``/health`` for ``board`` at ``now``; ``left_down``: the
    components a supervisor gave up on, and why."""
    states = board.readiness_view(now)
    ready = board.ready_instance_ids(now)
    body: dict[str, Any] = {
        "status": "ok", "instances": ready, "states": {i: str(s) for i, s in states.items()},
    }
    if left_down:
        body["left_down"] = dict(left_down)
    if ready:
        return 200, body
    reason = NO_INSTANCE_READY if states or left_down else NO_INSTANCE_KNOWN
    if left_down:
        reason = "; ".join([reason, *left_down.values()])
    return 503, {**body, "status": "unavailable", "reason": reason}


@router.get("/health")
async def health(gateway: GatewayDep, config: ConfigDep) -> Response:
    left_down = read_status(config.supervisor_status)
    status, body = health_body(gateway.board, gateway.clock(), left_down)
    # which process answers: ``shoal up`` checks that it is its own frontend, not another server's
    return json_response(status, {**body, "pid": os.getpid()})


@router.get("/metrics")
async def metrics(metrics: MetricsDep) -> Response:
    return Response(metrics.render(), media_type=CONTENT_TYPE)
