"""The narrow interface every shoal engine implements, and the data it speaks.

An engine runs one model instance: it queues, batches and preempts requests,
owns the instance's KV blocks, and copies a request's blocks to and from one
contiguous buffer for live migration (the paper's "narrow interface"). The
built-in engines (``sim`` here, ``torch`` next) share :mod:`agents.engines.block_manager`
and :mod:`agents.engines.local_scheduler`; a vLLM adapter implements the same
:class:`Engine` protocol on top of vLLM's own scheduler.

This module holds only the protocol and plain data types: request status and
finish reasons, per-step outputs, stats, the KV buffer, the static engine
description and the engine error tree. No engine logic, no I/O. The reject and
finish reasons are the wire's own enums (:mod:`schemas.reasons`), re-exported
here, so an engine's reason reaches the frontend as the same member.

Threading: an engine is not thread-safe. The agent serializes calls; with
``step_async`` other calls may run *between* a step's scheduling and its
completion (while it sleeps or computes), and the step then skips requests
that were aborted or released meanwhile.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import msgspec

from agents.engines.block_manager import CacheDelta, OutOfBlocks, Reservation
from schemas import Alternatives, KVLayout, ModelIdentity, SamplingParams
from schemas.reasons import FinishReason, RejectReason

__all__ = [
    "FINISH_REASONS",
    "CacheDelta",
    "Engine",
    "EngineError",
    "EngineInfo",
    "EngineStats",
    "FinishReason",
    "InvalidRequestState",
    "KVBuffer",
    "MigrationError",
    "OutOfBlocks",
    "PreemptionEvent",
    "RejectReason",
    "RejectionEvent",
    "RequestOutput",
    "RequestRejected",
    "RequestStats",
    "RequestStatus",
    "Reservation",
    "SchedulerEvent",
    "StepResult",
    "UnknownRequest",
    "expected_step_s",
]


# ------------------------------------------------------------------ statuses


class RequestStatus(enum.IntEnum):
    """Where a request is in its engine. FINISHED_* states are terminal."""

    WAITING = 0  # queued, never ran here (or arrived by rescue)
    RUNNING = 1  # in the batch, holds blocks
    SUSPENDED = 2  # holds its blocks but sits out of the batch (last migration stage)
    PREEMPTED = 3  # blocks freed; queued again to be recomputed
    FINISHED_STOPPED = 4  # EOS or a stop token
    FINISHED_LENGTH = 5  # max_tokens, the model's context or the instance's capacity
    FINISHED_ABORTED = 6  # aborted by the client or the agent

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def holds_blocks(self) -> bool:
        return self is RequestStatus.RUNNING or self is RequestStatus.SUSPENDED

    @property
    def is_queued(self) -> bool:
        return self is RequestStatus.WAITING or self is RequestStatus.PREEMPTED


#: Finish reason reported to clients (OpenAI's ``finish_reason``) per terminal status.
FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


# -------------------------------------------------------------------- errors


class EngineError(Exception):
    """Base of the engine layer's errors (block manager errors are re-exported as they are)."""


class RequestRejected(EngineError, ValueError):
    """``add_request`` refused a request; other requests are unaffected and it is counted.

    ``reason`` is one of the engine's :class:`RejectReason` members (never ``TERMINATING``,
    which is the agent's); ``detail`` is for people.
    """

    def __init__(self, request_id: str, reason: RejectReason, detail: str) -> None:
        super().__init__(f"request {request_id!r} rejected ({reason.value}): {detail}")
        self.request_id = request_id
        self.reason = reason
        self.detail = detail


class UnknownRequest(EngineError, KeyError):
    """No unfinished request with this id lives in the engine."""

    def __str__(self) -> str:
        return f"unknown request {self.args[0]!r}"


class InvalidRequestState(EngineError):
    """The request exists but its status does not allow the call (e.g. suspend a waiting one)."""


class MigrationError(EngineError):
    """A migration call with inconsistent arguments: blocks not reserved, wrong buffer size, ..."""


# ---------------------------------------------------------------- data types


class RequestOutput(msgspec.Struct, frozen=True):
    """One step's new tokens for one request (the agent wraps it in a ``schemas.TokenDelta``).

    ``first_index`` is the index of ``token_ids[0]`` among the request's
    generated tokens; ``finish_reason`` is set on the last output only.
    A msgspec struct rather than a dataclass: one is built per request per
    step, and a frozen dataclass costs ten times more to build.
    """

    request_id: str
    first_index: int
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    #: the sampled tokens' logprobs, if the request asks (``SamplingParams.logprobs``) and the engine has them
    logprobs: tuple[float, ...] | None = None
    #: per token, the most likely (token id, logprob) pairs, if the request asks (``top_logprobs``)
    top_logprobs: tuple[Alternatives, ...] | None = None
    #: prompt tokens served from the prefix cache when the request was first admitted here
    num_cached_tokens: int = 0
    #: ``SamplingParams.prompt_logprobs``, on the request's output with ``first_index`` 0: the logprob
    #: of each prompt token given the ones before it (None for the first) ...
    prompt_logprobs: tuple[float | None, ...] | None = None
    #: ... and at each prompt position the most likely (token id, logprob) pairs (empty for the first)
    prompt_top_logprobs: tuple[Alternatives, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class PreemptionEvent:
    """A running request was preempted by recompute (its blocks freed, queued again)."""

    request_id: str
    step_id: int
    num_blocks_freed: int


@dataclass(frozen=True, slots=True)
class RejectionEvent:
    """``add_request`` refused a request."""

    request_id: str
    reason: RejectReason
    detail: str


SchedulerEvent = PreemptionEvent | RejectionEvent


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one engine step produced.

    ``duration_s`` is the modeled step time (``sim``) or the measured one
    (``torch``); a virtual-clock simulator advances its clock by it.
    ``num_scheduled`` is 0 when there was nothing to run: a driver should then
    wait for new work instead of spinning.
    """

    outputs: list[RequestOutput]
    duration_s: float
    num_scheduled: int
    num_prefill_tokens: int = 0
    num_decode_requests: int = 0
    preempted: tuple[str, ...] = ()

    @property
    def finished(self) -> list[str]:
        return [o.request_id for o in self.outputs if o.finish_reason is not None]


def expected_step_s(last_step: tuple[float, int] | None, num_tokens: int) -> float:
    """How long a step of ``num_tokens`` should take, from the last one's ``(seconds, tokens)``
    scaled up by tokens (never down); infinite before any step. Engines use it to decide whether a
    step may compute with the caller's event loop blocked (``step_async(exclusive=True)``)."""
    if last_step is None:
        return float("inf")
    seconds, tokens = last_step
    return seconds * max(1.0, num_tokens / max(tokens, 1))


@dataclass(frozen=True, slots=True)
class RequestStats:
    """One unfinished request as the engine sees it (for load reports and migration)."""

    request_id: str
    status: RequestStatus
    priority: int
    num_blocks: int  # physical blocks held now
    num_tokens: int  # prompt + generated so far (the sequence length)
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens whose KV is in the blocks
    num_preemptions: int  # bumps on every preemption: a migration source checks it between stages
    arrival_seq: int


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of an engine's load: the inputs of virtual usage and freeness."""

    num_total_blocks: int
    num_free_blocks: int
    num_reserved_blocks: int
    num_running: int  # RUNNING (the batch)
    num_suspended: int
    num_waiting: int  # WAITING + PREEMPTED
    head_of_line_demand: int  # blocks the head of the queue needs to be admitted; 0 if none
    head_of_line_priority: int
    num_preemptions: int  # cumulative
    num_rejections: int  # cumulative
    num_finished: int  # cumulative, aborts included
    requests: tuple[RequestStats, ...]  # every unfinished request, running first
    prefix_cache_queries: int = 0  # cumulative tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # cumulative tokens of those found cached
    prefix_cache_evictions: int = 0  # cumulative cached blocks evicted to make room
    num_cached_blocks: int = 0  # blocks in the prefix cache now (in use or evictable)
    waiting_cached_blocks: int = 0  # blocks of the queued requests' prompts the prefix cache holds now


@dataclass(frozen=True, slots=True)
class KVBuffer:
    """Some blocks of one request fused into one contiguous buffer (block fusion).

    ``nbytes`` is the KV size these blocks really have (``num_blocks *
    bytes_per_block``). ``payload`` is what travels: for ``torch`` exactly
    ``nbytes`` bytes; for ``sim`` a small stand-in (8 bytes per block) that lets
    the destination check that the right blocks arrived, while ``nbytes`` keeps
    the accounting exact.
    """

    num_blocks: int
    nbytes: int
    payload: bytes | bytearray | memoryview

    @property
    def is_simulated(self) -> bool:
        return len(self.payload) != self.nbytes


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine is: announced in ``InstanceJoined`` and checked before migrating."""

    engine: str  # "sim", "torch", "vllm"
    model: ModelIdentity
    kv_layout: KVLayout
    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    max_batch_size: int
    vocab_size: int
    eos_token_id: int | None

    def can_migrate_to(self, other: EngineInfo) -> bool:
        """Migration needs the same model identity and KV layout on both sides."""
        return self.model == other.model and self.kv_layout == other.kv_layout


# ------------------------------------------------------------------ protocol


@runtime_checkable
class Engine(Protocol):
    """One model instance. Implemented by ``SimEngine``, the torch engine and a vLLM adapter.

    Request ids are unique among the engine's *unfinished* requests; once a
    request finishes (or is aborted or released) the engine forgets it.
    """

    @property
    def info(self) -> EngineInfo: ...

    # -- serving ---------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int = 0,
        *,
        output_token_ids: Sequence[int] = (),
    ) -> bool:
        """Queue a request. Returns False (and changes nothing) if the id is already here.

        ``output_token_ids`` are tokens a rescued request already generated; they
        are recomputed with the prompt and generation continues after them.
        Lower ``priority`` values run sooner (as in vLLM). Raises :class:`RequestRejected`.
        """
        ...

    def step(self) -> StepResult:
        """Run one iteration synchronously (the sim: no sleeping; the duration is modeled)."""
        ...

    async def step_async(self, *, exclusive: bool = False) -> StepResult:
        """Run one iteration in real time (the sim sleeps its modeled duration).

        ``exclusive``: nothing else needs the caller's event loop during this step, so an
        engine may compute a short step on the calling thread instead of handing it off.
        """
        ...

    def has_unfinished(self) -> bool: ...

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks; False if unknown. No output is emitted."""
        ...

    def stats(self) -> EngineStats: ...

    def request_stats(self, request_id: str) -> RequestStats | None: ...

    def output_token_ids(self, request_id: str) -> tuple[int, ...]:
        """The tokens a request has generated so far (raises :class:`UnknownRequest`)."""
        ...

    def take_events(self) -> list[SchedulerEvent]:
        """Preemptions and rejections since the last call (the agent counts and logs them)."""
        ...

    # -- prefix cache ----------------------------------------------------

    def take_cache_delta(self) -> CacheDelta:
        """The block hashes (:mod:`schemas.block_hash`) the prefix cache stored and removed since
        the last call, net; empty when the cache is off."""
        ...

    def cached_block_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds now (a full re-sync of the scheduler's index)."""
        ...

    def reset_prefix_cache(self) -> None:
        """Forget every cached block not in use and zero the cache's counters (after the warm-up)."""
        ...

    # -- migration -------------------------------------------------------

    def export_blocks(self, request_id: str, block_indices: Sequence[int]) -> KVBuffer:
        """Copy blocks ``block_indices`` (positions in the request's block table) into one buffer."""
        ...

    def reserve(self, num_blocks: int) -> Reservation:
        """Set free blocks aside for an incoming migration; raises :class:`OutOfBlocks`."""
        ...

    def import_blocks(self, block_ids: Sequence[int], buffer: KVBuffer) -> None:
        """Write a buffer into blocks that are currently reserved (of any live reservation)."""
        ...

    def admit_migrated(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        sampling: SamplingParams,
        priority: int,
        reservations: Sequence[Reservation],
        *,
        num_computed_tokens: int | None = None,
    ) -> None:
        """Add a migrated request straight to the running batch.

        Its block table is the concatenation of ``reservations``' blocks (which
        stop being reservations). ``num_computed_tokens`` defaults to all tokens
        but the last generated one, as after a decode step.
        """
        ...

    def release_request(self, request_id: str) -> int:
        """Forget a request that now lives elsewhere and free its blocks; returns how many."""
        ...

    def release_reservation(self, reservation: Reservation) -> int:
        """Return a reservation's blocks to the free list; returns how many."""
        ...

    def suspend(self, request_id: str) -> None:
        """Keep a running request's blocks but leave it out of the batch (from the next step)."""
        ...

    def resume(self, request_id: str) -> None:
        """Put a suspended request back into the batch."""
        ...
