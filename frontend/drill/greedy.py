"""What a greedy answer must read when nothing went wrong, per engine, and how the drill compares it.

* :class:`RecordedText` (torch, vllm): a greedy answer depends only on its
  prompt, so the drill sends each greedy prompt alone before the load starts
  and keeps the text; every greedy answer under load must equal its prompt's
  text exactly.
* :class:`SimTokens` (sim): output token ``k`` of a sim request is
  :func:`~agents.engines.sim.sim_token_id` of the request id, the seed (none for
  a greedy request) and ``k``, so the drill computes each answer's tokens from the
  id the response carries, with the profile's vocabulary and EOS id, as the
  engine does. A migration or a rescue keeps the request id and continues at
  the next index, so the answer must be the same tokens. The frontend renders
  the byte tokenizer's ids 0..255 as UTF-8 bytes and skips the rest (special
  ids); random bytes include invalid UTF-8, whose rendering (how many U+FFFD,
  or a multi-byte character) depends on how the tokens were split into deltas.
  So the text is compared with each run of non-ASCII characters taken as one
  U+FFFD: the ASCII characters (ids 1..127) and where runs of other bytes fall
  between them, which every split renders alike. A token that changed is seen
  when it or the token it replaced is a byte (about a quarter of
  ``tiny-test``'s 1,000 ids) and the change is not inside one run of non-ASCII
  bytes; a stream that goes wrong from some point on differs within a few tokens.

A comparison is impossible where neither applies (:func:`greedy_text` returns
None): the verdict then says "not checked" and does not count as passed.
"""

from __future__ import annotations

import re
from typing import Protocol

__all__ = ["GreedyText", "RecordedText", "SimTokens", "greedy_text"]

_NON_ASCII_RUN = re.compile(r"[^\x00-\x7f]+")


class GreedyText(Protocol):
    """How one drill knows the no-fault text of a greedy answer."""

    #: what the answer is compared with, for the report
    method: str

    def expected(self, request_id: str, prompt_id: int) -> str | None:
        """The answer's no-fault text; None when it cannot be known for this answer."""
        ...

    def compared(self, text: str) -> str:
        """The part of a text that is compared (the same function for the answer and the expectation)."""
        ...


class RecordedText:
    """Each greedy prompt's answer, recorded before the load (no fault): compared exactly."""

    method = "the prompt's answer recorded before the load (exact)"

    def __init__(self) -> None:
        self.texts: dict[int, str] = {}

    def expected(self, request_id: str, prompt_id: int) -> str | None:
        return self.texts.get(prompt_id)

    def compared(self, text: str) -> str:
        return text


class SimTokens:
    """The sim engine's tokens for the request id, computed as the engine computes them."""

    method = "the sim engine's tokens for the request id (non-ASCII runs as one U+FFFD)"

    def __init__(self, profile: str, output_tokens: int) -> None:
        from agents.engines.profile import load_profile
        from frontend.tokenization import load_frontend_tokenizer

        loaded = load_profile(profile)
        self.vocab_size = loaded.vocab_size
        self.eos_token_id = loaded.eos_token_id
        self.output_tokens = output_tokens
        self.tokenizer = load_frontend_tokenizer(f"sim:{profile}")

    def token_ids(self, request_id: str) -> list[int]:
        from agents.engines.sim import sim_token_id

        return [
            sim_token_id(request_id, None, index, self.vocab_size, self.eos_token_id)
            for index in range(self.output_tokens)
        ]

    def expected(self, request_id: str, prompt_id: int) -> str | None:
        if not request_id:
            return None
        return self.tokenizer.decode(self.token_ids(request_id))

    def compared(self, text: str) -> str:
        return _NON_ASCII_RUN.sub("\ufffd", text)


def greedy_text(engine: str, model: str, output_tokens: int, *, external: bool) -> GreedyText | None:
    """The comparison for a drill of ``engine`` agents serving ``model``; None where none is possible.

    A sim cluster the drill did not start may run any profile (the agents' own ``--model``), so its
    answers cannot be computed: None.
    """
    if engine != "sim":
        return RecordedText()
    if external:
        return None
    return SimTokens(model.removeprefix("sim:"), output_tokens)
