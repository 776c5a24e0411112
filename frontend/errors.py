"""OpenAI-format errors: one exception type carrying status, message, type, param and code.

Every error the API returns has the body ``{"error": {"message", "type",
"param", "code"}}`` with the status code OpenAI (and vLLM) use for it:
400 for malformed JSON and invalid parameters (``context_length_exceeded``
for prompts that do not fit), 401 for a missing or wrong API key, 404 for an
unknown model or route, 413 for an oversized body, 429 / 503 with
``Retry-After`` when the cluster cannot take more. The FastAPI handlers that
translate framework errors into this format live in :mod:`frontend.app`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "APIError",
    "context_length_exceeded",
    "error_body",
    "invalid_api_key",
    "invalid_parameter",
    "model_not_found",
    "overloaded",
    "unavailable",
]


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(Exception):
    """An error the client sees in OpenAI format. ``headers`` go on the response (e.g. Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def invalid_parameter(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_parameter")


def context_length_exceeded(message: str, param: str = "messages") -> APIError:
    return APIError(400, message, param=param, code="context_length_exceeded")


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model '{model}' does not exist.", param="model", code="model_not_found"
    )


def invalid_api_key() -> APIError:
    return APIError(
        401, "Incorrect or missing API key.", type_="authentication_error", code="invalid_api_key"
    )


def overloaded(retry_after_s: int) -> APIError:
    return APIError(
        429, "Too many requests in flight; retry later.", type_="rate_limit_error",
        code="rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)},
    )


def unavailable(message: str, retry_after_s: int) -> APIError:
    return APIError(
        503, message, type_="service_unavailable", code="service_unavailable",
        headers={"Retry-After": str(retry_after_s)},
    )
