"""``GET /v1/models``: the model names this frontend serves, with the context length instances announce.

Behind the API key like the generation routes; the list is the config's
``model_names`` (the served name first, then any extra aliases).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from frontend.dependencies import ConfigDep, GatewayDep, require_api_key
from frontend.http_responses import json_response

__all__ = ["models", "router"]

router = APIRouter()


@router.get("/v1/models", dependencies=[Depends(require_api_key)])
async def models(config: ConfigDep, gateway: GatewayDep) -> Response:
    created = int(time.time())
    max_model_len = gateway.max_model_len()
    data = [{"id": name, "object": "model", "created": created, "owned_by": "shoal",
             "max_model_len": max_model_len} for name in config.model_names]
    return json_response(200, {"object": "list", "data": data})
