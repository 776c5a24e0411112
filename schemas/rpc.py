"""Request/reply messages: generate, abort, resend, dispatch and scheduler commands.

RPCs ride core NATS on ``<prefix>.rpc.…``; only their outcomes are logged.
"""

from __future__ import annotations

from enum import StrEnum

from schemas.base import Message
from schemas.reasons import (
    CloseReason,
    CommandRejectReason,
    DispatchFailReason,
    RejectReason,
    RpcErrorCode,
)

__all__ = [
    "AbortReply",
    "AbortRequest",
    "CommandReply",
    "DispatchReply",
    "DispatchRequest",
    "Drain",
    "GenerateReply",
    "GenerateRequest",
    "Liveness",
    "MigrateOut",
    "MoveQueued",
    "ResendRequest",
    "RpcError",
    "RpcMessage",
    "SamplingParams",
    "StopMigration",
    "StructuredKind",
    "StructuredOutput",
    "TokenProbe",
]


class StructuredKind(StrEnum):
    """What :attr:`StructuredOutput.spec` holds."""

    #: a JSON schema, as JSON text: the output is one JSON value that validates against it
    JSON_SCHEMA = "json_schema"
    #: any JSON object (``response_format: json_object``); ``spec`` is empty
    JSON_OBJECT = "json_object"
    #: a regular expression the whole output matches
    REGEX = "regex"
    #: a JSON list of strings: the output is exactly one of them
    CHOICE = "choice"
    #: a context-free grammar: Lark syntax, or GBNF (``root ::= ...``) as vLLM accepts it
    GRAMMAR = "grammar"


class StructuredOutput(Message, frozen=True, kw_only=True, tag="structured"):
    """A constraint on the generated text, enforced by a token mask at every sampling step.

    The constraint's state is a function of the tokens generated so far, so an
    engine that takes over a request (migration, rescue) rebuilds it from them.
    """

    kind: StructuredKind
    spec: str = ""
    #: JSON kinds: allow whitespace between tokens as JSON does (False: the compact form only)
    any_whitespace: bool = True


class SamplingParams(Message, frozen=True, kw_only=True, tag="sampling"):
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    #: OpenAI's: subtracted from a token's logit once if it is among the generated tokens (presence),
    #: and once per time it is there (frequency)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    #: with ``logprobs``: also this many most likely tokens at each position, with their logprobs
    top_logprobs: int = 0
    #: vLLM's: a token whose probability is below ``min_p`` times the most likely token's is dropped
    #: (after temperature); 0 is off
    min_p: float = 0.0
    #: OpenAI's: (token id, bias) pairs added to the logits before sampling, bias in [-100, 100]
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: a grammar the output must follow (JSON schema, regex, choice, grammar); None: free text
    structured: StructuredOutput | None = None
    #: the logprob of every prompt token (the first has none) and this many alternatives at each
    #: position; None: no prompt logprobs. A request that asks skips the prefix cache (every
    #: prompt position must be computed), as in vLLM.
    prompt_logprobs: int | None = None


class GenerateRequest(Message, frozen=True, kw_only=True, tag="generate"):
    """Start a request on an instance. Idempotent by ``request_id``.

    ``num_prompt_tokens`` tells which of ``token_ids`` are the prompt; a
    rescued request carries its already generated tokens after them and
    ``first_index`` says which output index generation continues from.
    ``delta_subject``: publish this request's deltas in per-step
    :class:`~schemas.tokens.TokenDeltaBatch` messages on that subject (a
    frontend's, :meth:`~schemas.subjects.Subjects.tok_batch`) instead of one
    message per step on its own token subject.
    """

    request_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int = 0
    num_prompt_tokens: int | None = None
    first_index: int = 0
    owner_epoch: int = 0
    stream: bool = True
    delta_subject: str | None = None


class GenerateReply(Message, frozen=True, kw_only=True, tag="generate_reply"):
    """Whether the agent took the request; a refusal carries ``reason`` (and ``detail`` for people)."""

    request_id: str
    instance_id: str
    accepted: bool
    num_accepted: int
    reason: RejectReason | None = None
    detail: str = ""


class AbortRequest(Message, frozen=True, kw_only=True, tag="abort"):
    request_id: str
    reason: CloseReason = CloseReason.CLIENT


class AbortReply(Message, frozen=True, kw_only=True, tag="abort_reply"):
    request_id: str
    found: bool


class ResendRequest(Message, frozen=True, kw_only=True, tag="resend"):
    """Ask the owning agent to publish again the deltas from ``from_index`` on."""

    request_id: str
    from_index: int


class DispatchRequest(Message, frozen=True, kw_only=True, tag="dispatch_request"):
    """Frontend → scheduler: where should this request run?"""

    request_id: str
    num_prompt_tokens: int
    priority: int = 0
    exclude: tuple[str, ...] = ()
    #: the prompt's chained block hashes (:mod:`schemas.block_hash`) for blocks of ``block_size``
    #: tokens, for the prefix index; empty when the frontend does not compute them
    block_size: int = 0
    block_hashes: tuple[int, ...] = ()


class DispatchReply(Message, frozen=True, kw_only=True, tag="dispatch_reply"):
    """Where to run the request, or (``instance_id`` None) why the scheduler placed it nowhere."""

    request_id: str
    instance_id: str | None
    epoch: int
    reason: DispatchFailReason | None = None
    detail: str = ""


class MigrateOut(Message, frozen=True, kw_only=True, tag="migrate_out"):
    """Scheduler → source agent: move requests to ``destination_id`` until
    the source's freeness reaches ``target_freeness``."""

    epoch: int
    destination_id: str
    target_freeness: float
    #: Blocks the destination can take (:attr:`Paired.destination_room_blocks`); ``-1``: unchecked.
    room_blocks: int = -1
    #: A request whose owner epoch (its moves and rescues so far) reached this stays; 0: no limit.
    max_moves_per_request: int = 0


class MoveQueued(Message, frozen=True, kw_only=True, tag="move_queued"):
    """Scheduler → source agent: move ``request_id``, still queued and never run there, to
    ``destination_id`` without KV (a migration of zero blocks); see ``Dispatched.requeued_from``."""

    epoch: int
    request_id: str
    destination_id: str


class StopMigration(Message, frozen=True, kw_only=True, tag="stop_migration"):
    epoch: int
    destination_id: str


class Drain(Message, frozen=True, kw_only=True, tag="drain"):
    """Scheduler → agent: terminate by migrating every request away."""

    epoch: int


class RpcError(Message, frozen=True, kw_only=True, tag="rpc_error"):
    code: RpcErrorCode
    message: str


class CommandReply(Message, frozen=True, kw_only=True, tag="command_reply"):
    """An agent's answer to ``resend``, ``migrate_out``, ``stop_migration`` and ``drain``."""

    accepted: bool
    reason: CommandRejectReason | None = None  # set when not accepted
    detail: str = ""


class TokenProbe(Message, frozen=True, kw_only=True, tag="token_probe"):
    """Agent -> a request's token subject, sent as a request: is anyone still listening?

    Nobody answers it: a frontend that listens ignores it (the request times
    out), while NATS answers *no responders* at once when nothing subscribes —
    the request's frontend is gone, so the agent aborts the request.
    """

    request_id: str
    instance_id: str


class Liveness(Message, frozen=True, kw_only=True, tag="liveness"):
    """An agent's answer to the scheduler's liveness probe (its ``liveness`` RPC, core NATS).

    The scheduler asks an instance whose load reports stopped arriving before it marks it failed.
    Answering is not enough to stay in service: ``reporting`` says the agent's report loop is still
    running and began a report within its own bound (twice the append timeout plus the report
    interval). Reports then stop somewhere on the bus (a loads stream without a leader, say), not in
    the agent. An agent whose loop died or stopped answers ``reporting=False`` and is marked failed.
    """

    instance_id: str
    reporting: bool
    #: Seconds since the report loop last began a report; None: it never did.
    seconds_since_attempt: float | None = None
    #: Seconds since a report was last stored in the loads stream; None: none was.
    seconds_since_stored: float | None = None
    #: Why the last report append failed ('' when it succeeded).
    last_error: str = ""


RpcMessage = (
    GenerateRequest
    | GenerateReply
    | AbortRequest
    | AbortReply
    | ResendRequest
    | DispatchRequest
    | DispatchReply
    | MigrateOut
    | MoveQueued
    | StopMigration
    | Drain
    | RpcError
    | CommandReply
    | TokenProbe
    | Liveness
)

