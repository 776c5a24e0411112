"""Base struct configuration shared by every wire message, and the schema version.

Every message that crosses the bus is a frozen, keyword-only ``msgspec.Struct``
tagged by a short string in the ``type`` field, so that families of messages can
be decoded as tagged unions. Nothing here does I/O.
"""

from __future__ import annotations

import msgspec

__all__ = ["SCHEMA_CHANGES", "SCHEMA_VERSION", "Message"]

#: Bumped when a message changes incompatibly. Decoders reject newer versions; a message of an
#: older version is accepted if it still decodes, else rejected as ``UnsupportedVersion``.
SCHEMA_VERSION = 5

#: What changed in each schema version (date, change). Add a line with every bump.
SCHEMA_CHANGES: dict[int, str] = {
    1: "2026-11-29: first version.",
    2: (
        "2026-12-01: reasons are enums (schemas.reasons): GenerateReply.error -> reason + detail, "
        "DispatchReply.error -> reason + detail, CommandReply gains reason, RpcError.code, "
        "Abort.reason (+ detail), AbortRequest.reason, RequestAborted.reason, Unpaired.reason, "
        "InstanceFailed.reason (+ detail), InstanceTerminating.reason, TokenDelta.finish_reason "
        "and RequestFinished.finish_reason; free-text values of version 1 no longer decode."
    ),
    3: (
        "2026-12-02: decisions carry every input: ScaleUp/ScaleDown.inputs (ScalingInputs: clock and "
        "sustain timers), InstanceFailed.inputs (FailureInputs: clock, last seen, timeout, last report); "
        "the history stream's ArchivedLoads and Checkpoint (version 2 logs still decode; their scaling "
        "and failure decisions are not recomputable). TokenDeltaBatch (one agent step's deltas for one "
        "frontend) and GenerateRequest.delta_subject / Commit.delta_subject that ask for it; an agent of "
        "version 2 would publish per request where a version-3 frontend no longer listens, so it refuses."
    ),
    4: (
        "2026-12-05: CloseReason.NO_INSTANCE (a request whose instance failed and that no other instance "
        "took within the frontend's rescue timeout), on AbortRequest.reason and "
        "RequestAborted.reason; a version-3 reader rejects it. Version 3 messages still decode."
    ),
    5: (
        "2026-12-05: SamplingParams.structured (StructuredOutput: a JSON schema, JSON object, regex, "
        "choice or grammar the output follows), .min_p, .logit_bias and .prompt_logprobs; "
        "TokenDelta.prompt_logprobs and .prompt_top_logprobs. A version-4 agent would ignore the new "
        "fields and answer unconstrained, so it refuses them. Version 4 messages still decode."
    ),
}


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every wire message. Subclasses pass ``tag="..."``."""
