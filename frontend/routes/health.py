"""``GET /health`` (the live instances this frontend sees) and ``GET /metrics`` (Prometheus text).

Neither needs the API key: load balancers, ``shoal up`` and Prometheus poll them.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from frontend.dependencies import GatewayDep, MetricsDep
from frontend.http_responses import json_response
from frontend.metrics import CONTENT_TYPE

__all__ = ["health", "metrics", "router"]

router = APIRouter()


@router.get("/health")
async def health(gateway: GatewayDep) -> Response:
    live = gateway.board.live_instance_ids(gateway.clock())
    return json_response(200, {"status": "ok", "instances": live})


@router.get("/metrics")
async def metrics(metrics: MetricsDep) -> Response:
    return Response(metrics.render(), media_type=CONTENT_TYPE)
