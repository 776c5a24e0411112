"""Workloads for the simulator: real traces and synthetic arrivals and lengths.

* **Traces**: the Azure LLM inference traces of 2023 shipped in
  ``scheduler/sim/traces/`` (conversation and code: arrival times, prompt and
  output token counts), or a trace file: a CSV with the columns
  ``arrival_s,input_tokens,output_tokens``, or the published Azure, BurstGPT
  or Mooncake files as they are (:mod:`scheduler.sim.trace_formats`). A time scale (or a target mean
  rate) compresses or stretches the arrivals, which sets the load while
  keeping the trace's burstiness.
* **Synthetic arrivals**: Poisson, or Gamma inter-arrival times whose
  coefficient of variation (CV) sets the burstiness (CV 1 is Poisson).
* **Synthetic lengths** as in the Llumnix paper: power laws with means 128
  (Short), 256 (Medium) and 512 (Long) tokens, capped at 6k, combined as
  input-output mixes ``S-S``, ``M-M``, ``L-L``, ``S-L``, ``L-S``.
* **Multi-turn sessions** (:mod:`scheduler.sim.sessions`): each turn's prompt is the previous
  prompt, its answer and a new user message, sent a think time after the answer ends.
* A chosen share of requests gets the high priority (a *lower* value, as in vLLM).

A :class:`SimRequest` carries its output length: the simulator uses it to
stop the request (``max_tokens``); no policy ever sees it. Its prompt's token
ids are named by segments (:mod:`scheduler.sim.prompts`): a Mooncake trace's
hash ids become shared runs of tokens, so the engines' prefix cache finds what
prompts share. Everything is deterministic for a given seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np

from scheduler.sim.prompts import trace_block_segments
from scheduler.sim.trace_formats import read_trace

__all__ = [
    "AZURE_CREDIT",
    "LENGTH_MEANS",
    "MIXES",
    "TRACES",
    "TRACES_DIR",
    "SimRequest",
    "Workload",
    "build_workload",
    "gamma_arrivals",
    "load_trace",
    "power_law_exponent",
    "power_law_lengths",
    "synthetic_workload",
    "with_priorities",
]

TRACES_DIR = Path(__file__).with_name("traces")
#: Shipped traces by name.
TRACES: dict[str, Path] = {
    "azure-conv": TRACES_DIR / "azure2023_conv.csv",
    "azure-code": TRACES_DIR / "azure2023_code.csv",
    "mooncake": TRACES_DIR / "mooncake_synthetic.jsonl.gz",
}
AZURE_CREDIT = (
    'Trace: "Azure LLM inference trace 2023", Microsoft Azure Public Dataset (CC-BY 4.0), '
    'released with Patel et al., "Splitwise", ISCA 2024.'
)
#: Mean length, in tokens, of the paper's Short, Medium and Long power-law distributions.
LENGTH_MEANS: dict[str, float] = {"S": 128.0, "M": 256.0, "L": 512.0}
#: Input-output mixes of the paper.
MIXES = ("S-S", "M-M", "L-L", "S-L", "L-S")
#: Cap on synthetic lengths (the paper's 6k).
LENGTH_CAP = 6000


class SimRequest(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One request of a workload. ``num_output_tokens`` is known to the simulator only.

    ``segments`` name its prompt's tokens (:func:`scheduler.sim.prompts.prompt_token_ids`).
    A request that ``follows`` another (the next turn of a session) starts with that one's
    prompt and answer (or the first ``context_tokens`` of them), and arrives ``think_s`` after
    that answer's last token (``arrival_s`` is then unused); the others arrive at ``arrival_s``.
    """

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    priority: int = 0
    segments: tuple[tuple[int, int], ...] = ()
    follows: str = ""
    think_s: float = 0.0
    #: tokens of the previous turn's prompt and answer that a following turn's prompt starts with
    #: (None: all of them; 0: none, the prompt is its segments alone, as a recorded live session
    #: whose client re-encodes the previous answer's text)
    context_tokens: int | None = None


class Workload(msgspec.Struct, frozen=True, kw_only=True):
    """Requests in arrival order, a one-line description, and the credit owed to its source."""

    requests: tuple[SimRequest, ...]
    description: str
    credit: str = ""
    #: What the workload left out of what was asked (e.g. a trace shorter than ``--requests``).
    warnings: tuple[str, ...] = ()

    @property
    def duration_s(self) -> float:
        """The span of the arrivals set in advance (a session's later turns arrive as answers end)."""
        arrivals = [r.arrival_s for r in self.requests if not r.follows]
        return max(arrivals) - min(arrivals) if arrivals else 0.0

    @property
    def mean_rate(self) -> float:
        """Requests per second over the arrival span (0 for fewer than two requests)."""
        span = self.duration_s
        return (len(self.requests) - 1) / span if span > 0 else 0.0


def load_trace(
    name_or_path: str | Path,
    *,
    num_requests: int | None = None,
    start: int = 0,
    time_scale: float = 1.0,
    rate: float | None = None,
) -> Workload:
    """A trace as a workload: rows ``start .. start+num_requests``, arrivals from 0.

    Arrivals are divided by ``time_scale`` (2 = twice the load); ``rate``, if
    given, picks the time scale that makes the mean rate that many requests per
    second. The file may be in any format :mod:`~scheduler.sim.trace_formats`
    reads; rows with no prompt or no output tokens are dropped, and a warning
    says how many.
    """
    path = TRACES.get(str(name_or_path), Path(name_or_path))
    if not path.is_file():
        raise ValueError(f"no trace {str(name_or_path)!r} (shipped: {', '.join(TRACES)})")
    trace = read_trace(path)
    rows = trace.rows
    available = max(len(rows) - start, 0)
    stop = None if num_requests is None else start + num_requests
    rows = rows[start:stop]
    blocks = trace.blocks[start:stop]
    block_tokens = trace.format.block_tokens
    if not rows:
        raise ValueError(f"{path}: no requests in the chosen window")
    warnings: tuple[str, ...] = ()
    if trace.num_dropped:
        warnings += (f"{trace.num_dropped} rows of {path.name} have no prompt or no output tokens: left out",)
    if num_requests is not None and num_requests > available:
        warnings += (
            f"trace truncated: {num_requests} requests asked for, the trace has {available} usable rows "
            f"from row {start}; simulating {len(rows)}",
        )
    short = sum(1 for (_, i, _), b in zip(rows, blocks, strict=False) if len(b) * block_tokens < i)
    if short:
        warnings += (
            f"{short} rows' {trace.format.blocks} cover fewer tokens than their prompt: "
            "the rest of those prompts is their own",
        )
    origin = rows[0][0]
    natural = Workload(
        requests=tuple(
            SimRequest(request_id="", arrival_s=a - origin, num_prompt_tokens=i, num_output_tokens=o)
            for a, i, o in rows
        ),
        description="",
    )
    if rate is not None:
        if rate <= 0 or natural.mean_rate <= 0:
            raise ValueError("rate must be > 0 and the trace window must span some time")
        time_scale = rate / natural.mean_rate
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    requests = tuple(
        SimRequest(
            request_id=f"r{k:06d}", arrival_s=r.arrival_s / time_scale,
            num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=r.num_output_tokens,
            segments=trace_block_segments(blocks[k], block_tokens) if blocks else (),
        )
        for k, r in enumerate(natural.requests)
    )
    name = str(name_or_path) if str(name_or_path) in TRACES else path.name
    credit = AZURE_CREDIT if trace.format.name == "shoal" and "azure" in name else ""
    workload = Workload(
        requests=requests, description="", credit=credit or trace.format.credit, warnings=warnings
    )
    shown = name if trace.format.name == "shoal" else f"{name} ({trace.format.name} format)"
    description = (
        f"trace {shown}: {len(requests)} requests from row {start}, time scale {time_scale:.3g} "
        f"({workload.mean_rate:.2f} req/s)"
    )
    return msgspec.structs.replace(workload, description=description)


def gamma_arrivals(num: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (from 0) with Gamma inter-arrival times of mean ``1/rate`` and this CV.

    CV 1 gives a Poisson process; a larger CV is burstier.
    """
    if rate <= 0 or cv <= 0:
        raise ValueError("rate and cv must be > 0")
    shape = 1.0 / (cv * cv)
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=num)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _truncated_power_law_mean(exponent: float, cap: float) -> float:
    """Mean of the density proportional to ``x**-exponent`` on [1, cap]."""

    def integral(power: float) -> float:  # integral of x**power over [1, cap]
        if abs(power + 1.0) < 1e-9:
            return math.log(cap)
        return float((cap ** (power + 1.0) - 1.0) / (power + 1.0))

    return integral(1.0 - exponent) / integral(-exponent)


def power_law_exponent(mean: float, cap: float = LENGTH_CAP) -> float:
    """The exponent ``a`` of a power law ``x**-a`` on [1, cap] whose mean is ``mean`` (bisection)."""
    if not 1.0 < mean < (cap + 1.0) / 2.0:
        raise ValueError(f"mean must be in (1, {(cap + 1) / 2}), got {mean}")
    lo, hi = 0.0, 4.0  # the mean falls as the exponent grows; a=0 is uniform
    for _ in range(80):
        mid = (lo + hi) / 2.0
        if _truncated_power_law_mean(mid, cap) > mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0


def power_law_lengths(
    num: int, mean: float, rng: np.random.Generator, cap: int = LENGTH_CAP
) -> np.ndarray:
    """``num`` integer lengths in [1, cap] from a power law with this mean (inverse-CDF sampling)."""
    a = power_law_exponent(mean, cap)
    u = rng.random(num)
    if abs(a - 1.0) < 1e-9:
        x = np.power(float(cap), u)
    else:
        one_minus = 1.0 - a
        x = np.power(1.0 + u * (cap**one_minus - 1.0), 1.0 / one_minus)
    lengths: np.ndarray = np.clip(np.rint(x), 1, cap).astype(np.int64)
    return lengths


def _mix_means(mix: str) -> tuple[float, float]:
    parts = mix.upper().split("-")
    if len(parts) != 2 or any(p not in LENGTH_MEANS for p in parts):
        raise ValueError(f"mix must be two of S, M, L joined by '-', e.g. 'M-M'; got {mix!r}")
    return LENGTH_MEANS[parts[0]], LENGTH_MEANS[parts[1]]


def synthetic_workload(
    num_requests: int,
    rate: float,
    *,
    mix: str = "M-M",
    cv: float = 1.0,
    seed: int = 0,
) -> Workload:
    """Gamma(CV) arrivals at ``rate`` req/s (Poisson for CV 1) and power-law lengths of ``mix``."""
    if num_requests < 1:
        raise ValueError("num_requests must be >= 1")
    rng = np.random.default_rng(seed)
    input_mean, output_mean = _mix_means(mix)
    arrivals = gamma_arrivals(num_requests, rate, cv, rng)
    inputs = power_law_lengths(num_requests, input_mean, rng)
    outputs = power_law_lengths(num_requests, output_mean, rng)
    requests = tuple(
        SimRequest(
            request_id=f"r{k:06d}", arrival_s=float(arrivals[k]),
            num_prompt_tokens=int(inputs[k]), num_output_tokens=int(outputs[k]),
        )
        for k in range(num_requests)
    )
    arrival = "Poisson" if cv == 1.0 else f"Gamma CV {cv:g}"
    return Workload(
        requests=requests,
        description=(
            f"synthetic {mix.upper()}: {num_requests} requests, {arrival} at {rate:g} req/s, seed {seed}"
        ),
    )


def with_priorities(
    workload: Workload, high_share: float, *, seed: int = 0, high_priority: int = -1
) -> Workload:
    """The workload with a random ``high_share`` of its requests given ``high_priority``."""
    if not 0.0 <= high_share <= 1.0:
        raise ValueError("high_share must be in [0, 1]")
    if high_share == 0.0:
        return workload
    rng = np.random.default_rng(seed + 7919)
    draws = rng.random(len(workload.requests))
    requests: Sequence[SimRequest] = tuple(
        msgspec.structs.replace(r, priority=high_priority) if d < high_share else r
        for r, d in zip(workload.requests, draws, strict=True)
    )
    return msgspec.structs.replace(
        workload,
        requests=tuple(requests),
        description=f"{workload.description}, {high_share:.0%} high priority",
    )


def build_workload(
    name: str,
    *,
    num_requests: int,
    rate: float | None = None,
    cv: float = 1.0,
    seed: int = 0,
    high_share: float = 0.0,
    time_scale: float = 1.0,
    start: int = 0,
) -> Workload:
    """A workload by name: a trace (``azure-conv``, ``azure-code``, ``mooncake`` or a trace file) or a
    mix (``M-M``).

    Traces take ``rate`` (a target mean rate) or ``time_scale``; synthetic
    mixes need ``rate`` and take ``cv`` (Gamma arrivals; 1 is Poisson).
    """
    if name.upper() in MIXES or (len(name) == 3 and name[1] == "-"):
        if rate is None:
            raise ValueError(f"the synthetic workload {name!r} needs a rate")
        workload = synthetic_workload(num_requests, rate, mix=name, cv=cv, seed=seed)
    else:
        workload = load_trace(name, num_requests=num_requests, start=start, time_scale=time_scale, rate=rate)
    return with_priorities(workload, high_share, seed=seed)
