"""Request lifecycle events on ``<prefix>.ev.req.<request_id>``: appended by the frontend, except
``RequestAdmitted`` and ``RequestPreempted`` (by the agent whose engine runs the request)."""

from __future__ import annotations

from schemas.base import Message
from schemas.reasons import BypassReason, CloseReason, FinishReason

__all__ = [
    "RequestAborted",
    "RequestAdmitted",
    "RequestArrived",
    "RequestEvent",
    "RequestFinished",
    "RequestFirstToken",
    "RequestPlaced",
    "RequestPreempted",
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
    #: Why the frontend placed it itself (None: where the scheduler said, or not recorded).
    bypass_reason: BypassReason | None = None
    bypass_detail: str = ""


class RequestAdmitted(Message, frozen=True, kw_only=True, tag="req_admitted"):
    """The engine of ``instance_id`` ran the request for the first time (appended by the agent):
    ``queued_s`` after the agent accepted it (again after a preemption, with ``readmission``)."""

    request_id: str
    instance_id: str
    queued_s: float
    readmission: bool = False


class RequestPreempted(Message, frozen=True, kw_only=True, tag="req_preempted"):
    """The engine of ``instance_id`` preempted the request by recompute (appended by the agent)."""

    request_id: str
    instance_id: str
    num_blocks_freed: int = 0
    num_output_tokens: int = 0


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
    | RequestAdmitted
    | RequestPreempted
    | RequestFirstToken
    | RequestFinished
    | RequestRescued
    | RequestAborted
)
