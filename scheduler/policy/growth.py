"""Expected decode growth: the blocks running requests will still take, from an output length
learned online.

A running request keeps growing a block every ``block_size`` generated tokens until it
finishes, so an instance that looks free by its used blocks now may need that room shortly.
An agent (and the simulator's instance, the same way) learns the expected output length from
the requests it has finished (:class:`OutputLengthEstimate`, a running mean that becomes an
exponentially weighted mean after :data:`EWMA_HORIZON` requests) and reports, per load report,
:func:`expected_growth_blocks`: the most blocks its running requests are expected to need beyond
what they hold, as they decode to the expected output length and the shorter ones finish. The
scheduler reads only that
number from the report (``LoadReport.expected_growth_blocks``), so its decisions recompute from
the log. A request's own ``max_tokens`` is not used: in the simulator it is the true length
(an oracle) and live it is only a cap.

Pure except for the small estimator state an agent keeps; no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["EWMA_HORIZON", "OutputLengthEstimate", "expected_growth_blocks", "remaining_output_tokens"]

#: Finished requests after which the mean becomes an EWMA of weight ``1 / EWMA_HORIZON`` (so the
#: estimate follows a workload that changes, while the first requests are averaged evenly).
EWMA_HORIZON = 256


class OutputLengthEstimate:
    """The expected output length in tokens, learned from finished requests (0 before any)."""

    __slots__ = ("mean_output_tokens", "num_observed")

    def __init__(self) -> None:
        self.mean_output_tokens = 0.0
        self.num_observed = 0

    def observe(self, num_output_tokens: int) -> None:
        """One finished request generated ``num_output_tokens`` tokens."""
        self.num_observed += 1
        weight = 1.0 / min(self.num_observed, EWMA_HORIZON)
        self.mean_output_tokens += weight * (num_output_tokens - self.mean_output_tokens)

    @property
    def expected_output_tokens(self) -> int:
        """The mean rounded to whole tokens (what the growth counts)."""
        return round(self.mean_output_tokens)


def remaining_output_tokens(num_tokens: int, num_prompt_tokens: int, expected_output_tokens: int) -> int:
    """Tokens a running request is still expected to generate (0 once past the expected length)."""
    return max(expected_output_tokens - (num_tokens - num_prompt_tokens), 0)


def expected_growth_blocks(
    running: Iterable[tuple[int, int, int]], expected_output_tokens: int, block_size: int
) -> int:
    """The most blocks the running requests are expected to need beyond what they hold now.

    ``running`` is ``(num_tokens, num_prompt_tokens, num_blocks)`` of each request holding blocks.
    Each generates one token per step (continuous batching) until it reaches the expected output
    length, then finishes and frees its blocks; a request already past it is expected neither to
    grow nor to finish soon (it counts 0). After ``t`` steps the requests still running hold their
    tokens plus ``t`` each (counted in blocks together, so a partly filled block is not counted
    once per request) and the finished ones freed their blocks; the peak of that net growth over
    ``t`` (taken when a request is about to finish) is the number. Summing every
    request's whole remaining growth instead ignores the blocks finishing requests give back and
    counts an instance as full long before it would be. 0 while nothing has finished (no estimate).
    """
    if expected_output_tokens <= 0 or block_size <= 0:
        return 0
    growing = sorted(
        (remaining, tokens, blocks)
        for tokens, prompt, blocks in running
        if (remaining := remaining_output_tokens(tokens, prompt, expected_output_tokens)) > 0
    )
    # requests still running at step t (those expected to finish at t or later), as running sums
    tokens_left = sum(tokens for _, tokens, _ in growing)
    blocks_left = sum(blocks for _, _, blocks in growing)
    peak = freed = 0
    for k, (steps, tokens, blocks) in enumerate(growing):
        # their tokens after ``steps`` more each, in blocks, less the blocks they and the finished hold
        need = -(-(tokens_left + (len(growing) - k) * steps) // block_size) - blocks_left
        peak = max(peak, need - freed)
        tokens_left -= tokens
        blocks_left -= blocks
        freed += blocks
    return peak
