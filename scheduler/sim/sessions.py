"""Multi-turn chat sessions: a workload whose prompts grow turn by turn and share system prompts.

:func:`session_workload` draws ``num_sessions`` conversations:

* sessions start as a Poisson process at ``rate`` sessions per second;
* each belongs to one of ``groups`` groups (drawn uniformly; with ``hot_group_share``, that
  share of the sessions goes to group 0 and the rest uniformly to the others); a group's sessions
  open with the same system prompt of ``system_tokens`` tokens (an application's instructions);
* a session has ``turns`` turns; turn ``k``'s prompt is turn ``k - 1``'s prompt, its answer and
  a new user message; user messages and answers have power-law lengths with means
  ``user_tokens`` and ``answer_tokens`` (the Llumnix paper's distributions, capped at 6,000);
* a turn is sent a think time after the previous answer's last token, exponential with mean
  ``think_s`` (so a slow answer delays the rest of its session, as with a person);
* with ``max_context_tokens``, a session ends before a turn whose prompt and answer would pass it.

:func:`system_prompt_workload` is the one-turn case as llm-d's prefix-cache benchmark shapes it:
many groups of long shared system prompts (150 x 6,000 tokens), short questions, Poisson arrivals.

The draw is deterministic for a seed. The previous answer's token ids are the ones the engine
generated; the simulator puts them into the next prompt when it sends that turn
(:class:`~scheduler.sim.workload.SimRequest` ``follows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.sim.prompts import SESSION_SYSTEM, SESSION_USER, segment_seed
from scheduler.sim.workload import LENGTH_CAP, SimRequest, Workload, power_law_lengths

__all__ = ["SessionSpec", "session_workload", "system_prompt_workload"]


@dataclass(frozen=True, slots=True)
class SessionSpec:
    """What :func:`session_workload` draws (see the module docstring)."""

    num_sessions: int
    rate: float
    turns: int = 4
    groups: int = 4
    system_tokens: int = 1024
    user_tokens: float = 128.0
    answer_tokens: float = 256.0
    think_s: float = 10.0
    max_context_tokens: int | None = None
    seed: int = 0
    hot_group_share: float = 0.0

    def __post_init__(self) -> None:
        if self.num_sessions < 1 or self.turns < 1 or self.groups < 1:
            raise ValueError("sessions, turns and groups must be >= 1")
        if self.rate <= 0 or self.think_s < 0 or self.system_tokens < 0:
            raise ValueError("rate must be > 0, think time and system prompt length >= 0")
        if not 0.0 <= self.hot_group_share <= 1.0:
            raise ValueError(f"hot_group_share must be in [0, 1], got {self.hot_group_share}")
        for name in ("user_tokens", "answer_tokens"):
            mean = getattr(self, name)
            if not 1.0 < mean < (LENGTH_CAP + 1) / 2:
                raise ValueError(f"{name} must be a mean in (1, {(LENGTH_CAP + 1) // 2}), got {mean}")


def session_workload(spec: SessionSpec) -> Workload:
    """The sessions of ``spec``, each session's turns in order, sessions by start time."""
    rng = np.random.default_rng(spec.seed)
    n, turns = spec.num_sessions, spec.turns
    starts = np.cumsum(rng.exponential(1.0 / spec.rate, size=n))
    starts -= starts[0]
    groups = rng.integers(0, spec.groups, size=n)
    users = power_law_lengths(n * turns, spec.user_tokens, rng).reshape(n, turns)
    answers = power_law_lengths(n * turns, spec.answer_tokens, rng).reshape(n, turns)
    thinks = rng.exponential(spec.think_s, size=(n, turns)) if spec.think_s > 0 else np.zeros((n, turns))
    if spec.hot_group_share > 0 and spec.groups > 1:  # group 0 takes that share, the rest the others
        hot = rng.random(n) < spec.hot_group_share
        groups = np.where(hot, 0, rng.integers(1, spec.groups, size=n))
    limit = spec.max_context_tokens
    requests: list[SimRequest] = []
    num_cut = 0
    for session in range(n):
        previous = ""
        context = 0  # the previous turn's prompt and answer
        for turn in range(turns):
            user = (segment_seed(SESSION_USER, session, turn), int(users[session, turn]))
            if turn == 0 and spec.system_tokens:
                segments: tuple[tuple[int, int], ...] = (
                    (segment_seed(SESSION_SYSTEM, int(groups[session])), spec.system_tokens),
                    user,
                )
            else:
                segments = (user,)
            num_prompt = context + sum(length for _, length in segments)
            num_answer = int(answers[session, turn])
            if limit is not None and turn > 0 and num_prompt + num_answer > limit:
                num_cut += 1
                break
            request_id = f"s{session:05d}.{turn:02d}"
            requests.append(
                SimRequest(
                    request_id=request_id,
                    arrival_s=float(starts[session]),
                    num_prompt_tokens=num_prompt,
                    num_output_tokens=num_answer,
                    segments=segments,
                    follows=previous,
                    think_s=float(thinks[session, turn]) if previous else 0.0,
                )
            )
            previous, context = request_id, num_prompt + num_answer
    description = (
        f"sessions: {n} of up to {turns} turns ({len(requests)} requests), {spec.groups} system prompts "
        f"of {spec.system_tokens} tokens, user / answer mean {spec.user_tokens:g} / {spec.answer_tokens:g} "
        f"tokens, think {spec.think_s:g} s, {spec.rate:g} sessions/s, seed {spec.seed}"
    )
    if spec.hot_group_share > 0:
        description += f", {spec.hot_group_share:.0%} of sessions in group 0"
    warnings: tuple[str, ...] = ()
    if num_cut:
        warnings = (f"{num_cut} sessions end early: their next turn would pass {limit} tokens of context",)
    return Workload(requests=tuple(requests), description=description, warnings=warnings)


def system_prompt_workload(
    num_requests: int,
    rate: float,
    *,
    groups: int = 150,
    system_tokens: int = 6000,
    question_tokens: float = 128.0,
    answer_tokens: float = 256.0,
    hot_group_share: float = 0.0,
    seed: int = 0,
) -> Workload:
    """``num_requests`` one-turn requests, Poisson at ``rate`` req/s, each a group's system prompt
    of ``system_tokens`` tokens and a question (power law, mean ``question_tokens``); answers
    have mean ``answer_tokens`` (see :class:`SessionSpec` for ``hot_group_share``)."""
    spec = SessionSpec(
        num_sessions=num_requests, rate=rate, turns=1, groups=groups, system_tokens=system_tokens,
        user_tokens=question_tokens, answer_tokens=answer_tokens, think_s=0.0, seed=seed,
        hot_group_share=hot_group_share,
    )
    workload = session_workload(spec)
    hot = f", {hot_group_share:.0%} of requests in group 0" if hot_group_share > 0 else ""
    description = (
        f"system-prompt groups: {num_requests} requests, Poisson at {rate:g} req/s, {groups} groups of "
        f"{system_tokens}-token system prompts{hot}, question / answer mean {question_tokens:g} / "
        f"{answer_tokens:g} tokens, seed {seed}"
    )
    return Workload(requests=workload.requests, description=description, warnings=workload.warnings)
