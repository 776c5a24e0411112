"""Per-request token bookkeeping: the deltas recently published, for ``resend``.

:class:`DeltaBuffer` keeps, per request, the last few :class:`~schemas.TokenDelta`
messages published and every output token so far (for non-streaming requests,
which get one delta with all tokens at the end), and its prompt logprobs if it asked for them
(they ride on the delta with ``first_index`` 0, of a resend from 0 too). Finished requests keep their
buffer for a while (a bounded number of them), so a client that lost the last
delta can still ask for it. Pure bookkeeping: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import msgspec

from schemas import Alternatives, SamplingParams, TokenDelta

__all__ = ["DeltaBuffer", "RequestTokens"]


@dataclass
class RequestTokens:
    """One request as the agent serves it: how to continue it elsewhere, its epoch, its tokens so far."""

    request_id: str
    owner_epoch: int
    stream: bool
    prompt_token_ids: tuple[int, ...]
    output_token_ids: list[int]
    sampling: SamplingParams
    priority: int
    recent: deque[TokenDelta] = field(default_factory=deque)
    finished: bool = False
    #: where its deltas go in per-step batches (``GenerateRequest.delta_subject``); None: its own subject
    delta_subject: str | None = None
    #: its prompt logprobs once the engine gave them (``SamplingParams.prompt_logprobs``): a resend
    #: from index 0 carries them again, however long ago the first delta went out
    prompt_logprobs: tuple[float | None, ...] | None = None
    prompt_top_logprobs: tuple[Alternatives, ...] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class DeltaBuffer:
    """Recent deltas per live request, and of the last ``finished_limit`` finished ones."""

    def __init__(self, *, steps_per_request: int, finished_limit: int) -> None:
        self._steps = steps_per_request
        self._finished_limit = finished_limit
        self._live: dict[str, RequestTokens] = {}
        self._finished: OrderedDict[str, RequestTokens] = OrderedDict()

    def open(
        self,
        request_id: str,
        *,
        owner_epoch: int,
        stream: bool,
        prompt_token_ids: tuple[int, ...],
        sampling: SamplingParams,
        priority: int,
        output_token_ids: tuple[int, ...] | list[int] = (),
        delta_subject: str | None = None,
    ) -> RequestTokens:
        self._finished.pop(request_id, None)
        tokens = RequestTokens(
            request_id=request_id,
            owner_epoch=owner_epoch,
            stream=stream,
            prompt_token_ids=tuple(prompt_token_ids),
            output_token_ids=list(output_token_ids),
            sampling=sampling,
            priority=priority,
            recent=deque(maxlen=self._steps),
            delta_subject=delta_subject,
        )
        self._live[request_id] = tokens
        return tokens

    def get(self, request_id: str) -> RequestTokens | None:
        return self._live.get(request_id) or self._finished.get(request_id)

    def live(self, request_id: str) -> RequestTokens | None:
        return self._live.get(request_id)

    def live_ids(self) -> list[str]:
        """The requests this agent publishes tokens for now."""
        return list(self._live)

    def record(self, delta: TokenDelta) -> None:
        """Remember a delta that was published."""
        tokens = self.get(delta.request_id)
        if tokens is not None:
            tokens.recent.append(delta)

    def close(self, request_id: str) -> None:
        """The request finished (or left): keep its buffer among the finished ones."""
        tokens = self._live.pop(request_id, None)
        if tokens is None or self._finished_limit == 0:
            return
        tokens.finished = True
        self._finished[request_id] = tokens
        while len(self._finished) > self._finished_limit:
            self._finished.popitem(last=False)

    def forget(self, request_id: str) -> None:
        self._live.pop(request_id, None)
        self._finished.pop(request_id, None)

    def resend(self, request_id: str, from_index: int) -> list[TokenDelta] | None:
        """The buffered deltas covering tokens from ``from_index`` on (trimmed), or None if unknown."""
        tokens = self.get(request_id)
        if tokens is None:
            return None
        out: list[TokenDelta] = []
        for delta in tokens.recent:
            end = delta.first_index + len(delta.token_ids)
            if end <= from_index and not (delta.finish_reason is not None and end == from_index):
                continue
            skip = max(0, from_index - delta.first_index)
            if skip:
                delta = TokenDelta(
                    request_id=delta.request_id,
                    instance_id=delta.instance_id,
                    owner_epoch=delta.owner_epoch,
                    first_index=delta.first_index + skip,
                    token_ids=delta.token_ids[skip:],
                    logprobs=None if delta.logprobs is None else delta.logprobs[skip:],
                    top_logprobs=None if delta.top_logprobs is None else delta.top_logprobs[skip:],
                    finish_reason=delta.finish_reason,
                    num_prompt_tokens=delta.num_prompt_tokens,
                    num_cached_tokens=delta.num_cached_tokens,
                )
            out.append(delta)
        if (
            from_index == 0 and out and out[0].first_index == 0 and out[0].prompt_logprobs is None
            and tokens.prompt_logprobs is not None
        ):
            out[0] = msgspec.structs.replace(
                out[0], prompt_logprobs=tokens.prompt_logprobs, prompt_top_logprobs=tokens.prompt_top_logprobs
            )
        return out

    @property
    def num_live(self) -> int:
        return len(self._live)
