"""Request lifecycle events, appended by the frontend on ``<prefix>.ev.req.<request_id>``."""

from __future__ import annotations

from schemas.base import Message
from schemas.reasons import CloseReason, FinishReason

__all__ = [
    "RequestAborted",
    "RequestArrived",
    "RequestEvent",
    "RequestFinished",
    "RequestFirstToken",
    "RequestPlaced",
    "RequestRescued",
]


class RequestArrived(Message, frozen=True, kw_only=True, tag="req_arrived"):
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    priority: int = 0


class RequestPlaced(Message, frozen=True, kw_only=True, tag="req_placed"):
    request_id: str
    instance_id: str
    bypass: bool = False


class RequestFirstToken(Message, frozen=True, kw_only=True, tag="req_first_token"):
    request_id: str
    instance_id: str
    ttft_s: float


class RequestFinished(Message, frozen=True, kw_only=True, tag="req_finished"):
    request_id: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_output_tokens: int
    e2e_s: float


class RequestRescued(Message, frozen=True, kw_only=True, tag="req_rescued"):
    request_id: str
    failed_instance_id: str
    new_instance_id: str
    num_tokens_kept: int


class RequestAborted(Message, frozen=True, kw_only=True, tag="req_aborted"):
    request_id: str
    reason: CloseReason


RequestEvent = (
    RequestArrived
    | RequestPlaced
    | RequestFirstToken
    | RequestFinished
    | RequestRescued
    | RequestAborted
)
