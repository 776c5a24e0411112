"""The warm-up request an agent runs through its engine before it announces itself.

An agent is *ready* (``InstanceJoined`` on the bus, then load reports, its
``--ready-file``) only once its engine has served one real request end to end:
:func:`warm_up` adds a short greedy request (:data:`WARM_UP_PROMPT`,
:data:`WARM_UP_SAMPLING`: a prefill and one decode step) with the engine's
``add_request`` and runs the engine's ``step_async`` until it finishes, the
calls the agent's step loop makes for a client's request. An engine that
cannot compute on this machine (a kernel that raises, a process that dies of
an illegal instruction) therefore fails here, before any request could be
placed on it.

It leaves no trace a client sees: it runs before the agent serves RPCs or
publishes anything, its tokens go nowhere, its request is in no event log and
in none of the agent's request metrics (the step loop's listeners never see
its steps), and the engine's scheduler events it caused are discarded. The
engine must end it with every block free and nothing unfinished, else the
warm-up fails: a pool that leaks on the first request would leak on every one.

:func:`inject_first_step_fault` is the test hook of
:class:`~agents.config.FirstStepFault`. Not here: the step loop itself
(:mod:`agents.service`).
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from agents.config import FirstStepFault, InjectedStepFault
from agents.engines.protocol import Engine, FinishReason, StepResult
from schemas import SamplingParams

__all__ = [
    "WARM_UP_PROMPT",
    "WARM_UP_REQUEST_ID",
    "WARM_UP_SAMPLING",
    "WarmUp",
    "WarmUpFailed",
    "inject_first_step_fault",
    "warm_up",
]

#: The warm-up's request id: never on the bus, and finished before any client request arrives.
WARM_UP_REQUEST_ID = "shoal-warm-up"
#: Four ordinary token ids (every vocabulary has them): short enough to take the kernels a short
#: client prompt takes, which are not always those a long prefill takes.
WARM_UP_PROMPT = (1, 2, 3, 4)
#: Greedy, two tokens: the first comes from the prefill step, the second from a decode step.
WARM_UP_SAMPLING = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


class WarmUpFailed(RuntimeError):
    """The engine could not serve the warm-up request; the agent must not announce itself."""


@dataclass(frozen=True, slots=True)
class WarmUp:
    """What the warm-up took: its tokens, the engine steps and the seconds."""

    token_ids: tuple[int, ...]
    num_steps: int
    seconds: float


def _dtype_hint(engine: Engine) -> str:
    dtype = engine.info.model.dtype
    if dtype in ("float32", ""):
        return ""
    return f" (the model runs in {dtype}; an engine that cannot compute in {dtype} here may in float32: " \
        "--dtype float32)"


async def warm_up(
    engine: Engine, step: Callable[[], Awaitable[StepResult]], *, timeout_s: float
) -> WarmUp:
    """Run the warm-up request through ``engine`` with ``step`` (the agent's engine step).

    Raises :class:`WarmUpFailed` when the engine refuses it, a step raises, it does not finish
    within ``timeout_s``, it yields other than two tokens, or it leaves blocks held or work behind.
    """
    started = time.perf_counter()
    free_before = engine.stats().num_free_blocks
    try:
        engine.add_request(WARM_UP_REQUEST_ID, WARM_UP_PROMPT, WARM_UP_SAMPLING)
    except Exception as exc:
        raise WarmUpFailed(f"the engine refused the warm-up request: {exc}") from exc
    tokens: list[int] = []
    finish: FinishReason | None = None
    num_steps = 0
    try:
        async with asyncio.timeout(timeout_s):
            while engine.has_unfinished():
                result = await step()
                num_steps += 1
                for output in result.outputs:
                    if output.request_id == WARM_UP_REQUEST_ID:
                        tokens.extend(output.token_ids)
                        finish = output.finish_reason or finish
    except TimeoutError:
        raise WarmUpFailed(
            f"the warm-up request did not finish within {timeout_s:g} s ({num_steps} steps)"
        ) from None
    except Exception as exc:
        hint = "" if isinstance(exc, InjectedStepFault) else _dtype_hint(engine)
        raise WarmUpFailed(
            f"the engine's step failed on the warm-up request: {type(exc).__name__}: {exc}{hint}"
        ) from exc
    engine.take_events()  # its own admission: not a client's, never logged
    expected = WARM_UP_SAMPLING.max_tokens
    if len(tokens) != expected or finish is not FinishReason.LENGTH:
        raise WarmUpFailed(f"the warm-up request gave {len(tokens)} token(s) ({finish}), not {expected}")
    vocab = engine.info.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise WarmUpFailed(f"the warm-up request gave token ids {tokens} outside the vocabulary of {vocab}")
    stats = engine.stats()
    if stats.num_free_blocks != free_before or stats.requests:
        raise WarmUpFailed(
            f"the warm-up request left {free_before - stats.num_free_blocks} block(s) held and "
            f"{len(stats.requests)} request(s) unfinished"
        )
    reset = getattr(engine, "reset_prefix_cache", None)
    if reset is not None:
        reset()  # a client's first prompt must not hit (or be counted against) the warm-up's blocks
    return WarmUp(tuple(tokens), num_steps, time.perf_counter() - started)


def inject_first_step_fault(fault: FirstStepFault) -> None:
    """Make this step fail as ``fault`` says: raise, or die of ``SIGILL`` (see :class:`FirstStepFault`)."""
    if fault is FirstStepFault.RAISE:
        raise InjectedStepFault("injected fault: the engine's first step raised (--fault-first-step raise)")
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file where the agent runs
    signal.signal(signal.SIGILL, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGILL)
    os._exit(128 + signal.SIGILL)  # only if something ignored the signal
