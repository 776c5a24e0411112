"""``GET /v1/models`` and ``GET /v1/models/{model}``: the model names this frontend serves, with the
context length instances announce.

Behind the API key like the generation routes; the list is the config's
``model_names`` (the served name first, then any extra aliases); a name it does
not serve is OpenAI's 404 ``model_not_found``. A name may hold slashes
(``meta-llama/Llama-3.1-8B``), as Hugging Face ids do.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends
from fastapi.responses import Response

from frontend.dependencies import ConfigDep, GatewayDep, require_api_key
from frontend.errors import model_not_found
from frontend.http_responses import json_response

__all__ = ["model", "models", "router"]

router = APIRouter()


def _card(name: str, max_model_len: int) -> dict[str, object]:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "shoal",
            "max_model_len": max_model_len}


@router.get("/v1/models", dependencies=[Depends(require_api_key)])
async def models(config: ConfigDep, gateway: GatewayDep) -> Response:
    max_model_len = gateway.max_model_len()
    data = [_card(name, max_model_len) for name in config.model_names]
    return json_response(200, {"object": "list", "data": data})


@router.get("/v1/models/{name:path}", dependencies=[Depends(require_api_key)])
async def model(name: str, config: ConfigDep, gateway: GatewayDep) -> Response:
    if name not in config.model_names:
        raise model_not_found(name)
    return json_response(200, _card(name, gateway.max_model_len()))
