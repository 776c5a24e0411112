"""Per-request reassembly of token deltas into one ordered stream. Pure: no I/O, no clock.

Agents publish :class:`~schemas.TokenDelta` messages on the request's token
subject; during a migration or after a rescue another instance continues the
same subject with a higher ``owner_epoch``. :class:`DeltaAssembler` makes one
gap-free, duplicate-free sequence of generated tokens out of them, whichever
instance publishes:

* a delta of an owner epoch older than the newest seen (or than the epoch the
  frontend itself started after a rescue) is *stale* and dropped;
* tokens before ``num_delivered`` are duplicates and dropped (a delta that
  overlaps contributes only its new tail);
* a delta that starts beyond ``num_delivered`` is held until the gap before it
  is filled; :attr:`gap_from` says from which index the owner must resend;
* the delta carrying ``finish_reason`` ends the stream once everything before
  it arrived;
* the prompt logprobs (``SamplingParams.prompt_logprobs``) ride on a delta with
  ``first_index`` 0 and are kept from the first one taken that has them.
"""

from __future__ import annotations

import msgspec

from schemas import Alternatives, FinishReason, TokenDelta

__all__ = ["Accepted", "DeltaAssembler"]


class Accepted(msgspec.Struct, frozen=True, gc=False):
    """What one delta released: new tokens in order (maybe none), their logprobs, and the end."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] | None = None
    finish_reason: FinishReason | None = None
    top_logprobs: tuple[Alternatives, ...] | None = None


_NOTHING = Accepted()


class DeltaAssembler:
    """Orders, de-duplicates and epoch-filters one request's deltas. See the module docstring."""

    def __init__(self, *, first_index: int = 0, owner_epoch: int = 0) -> None:
        self.num_delivered = first_index
        self.owner_epoch = owner_epoch
        self.owner_id: str | None = None
        self.finish_reason: FinishReason | None = None
        self.num_stale = 0
        self.num_duplicates = 0
        self._held: dict[int, TokenDelta] = {}
        #: the request's prompt logprobs and alternatives, once a delta brought them
        self.prompt_logprobs: tuple[float | None, ...] | None = None
        self.prompt_top_logprobs: tuple[Alternatives, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def gap_from(self) -> int | None:
        """The first missing index when later deltas are waiting for it; None without a gap."""
        return self.num_delivered if self._held else None

    def expect_epoch(self, owner_epoch: int, owner_id: str | None = None) -> None:
        """From now on accept only deltas of ``owner_epoch`` or newer (the frontend moved the request)."""
        if owner_epoch > self.owner_epoch:
            self.owner_epoch = owner_epoch
            self._held.clear()
        if owner_id is not None:
            self.owner_id = owner_id

    def accept(self, delta: TokenDelta) -> Accepted:
        if self.finished:
            self.num_duplicates += 1
            return _NOTHING
        if delta.owner_epoch < self.owner_epoch:
            self.num_stale += 1
            return _NOTHING
        if delta.owner_epoch > self.owner_epoch:
            self.owner_epoch = delta.owner_epoch
            self._held = {k: d for k, d in self._held.items() if d.owner_epoch >= delta.owner_epoch}
        self.owner_id = delta.instance_id
        if delta.prompt_logprobs is not None and delta.first_index == 0 and self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
            self.prompt_top_logprobs = delta.prompt_top_logprobs
        end = delta.first_index + len(delta.token_ids)
        if delta.first_index > self.num_delivered:
            self._held[delta.first_index] = delta
            return _NOTHING
        if end < self.num_delivered or (end == self.num_delivered and delta.finish_reason is None):
            if delta.token_ids:
                self.num_duplicates += 1
            return _NOTHING
        tokens: list[int] = []
        logprobs: list[float] | None = [] if delta.logprobs is not None else None
        top: list[Alternatives] | None = [] if delta.top_logprobs is not None else None
        finish = self._take(delta, tokens, logprobs, top)
        while finish is None and self._held:
            candidates = [k for k in self._held if k <= self.num_delivered]
            if not candidates:
                break
            for key in sorted(candidates, key=int):
                held = self._held.pop(key)
                if held.first_index + len(held.token_ids) < self.num_delivered:
                    self.num_duplicates += 1
                    continue
                finish = self._take(held, tokens, logprobs, top)
                if finish is not None:
                    break
        if finish is not None:
            self.finish_reason = finish
            self._held.clear()
        return Accepted(
            token_ids=tuple(tokens),
            logprobs=tuple(logprobs) if logprobs is not None else None,
            top_logprobs=tuple(top) if top is not None else None,
            finish_reason=finish,
        )

    def _take(
        self,
        delta: TokenDelta,
        tokens: list[int],
        logprobs: list[float] | None,
        top: list[Alternatives] | None,
    ) -> FinishReason | None:
        skip = self.num_delivered - delta.first_index
        new = delta.token_ids[skip:]
        tokens.extend(new)
        if logprobs is not None:
            if delta.logprobs is not None and len(delta.logprobs) == len(delta.token_ids):
                logprobs.extend(delta.logprobs[skip:])
            else:
                logprobs.extend(0.0 for _ in new)
        if top is not None:
            if delta.top_logprobs is not None and len(delta.top_logprobs) == len(delta.token_ids):
                top.extend(delta.top_logprobs[skip:])
            else:
                top.extend(() for _ in new)
        self.num_delivered += len(new)
        return delta.finish_reason
