"""``shoal bench prefix``: automatic prefix caching, live: the cache on and off, or dispatch policies,
side by side.

**Sessions** (the default mode): multi-turn chat sessions against ``shoal up``
(torch engine, preset ``small``, two instances, one torch thread each). The
sessions come in groups; the sessions of a group share a system prompt, and
each turn's prompt is the conversation so far: the system prompt, every earlier
user message and answer, and a new user message (a chat client's prompt grows
by one exchange per turn). A session waits a think time between its turns and
the sessions start spread over a ramp, so turns of different sessions overlap.
Every request streams (httpx, SSE), greedy, ``ignore_eos``, with usage.

Two clusters run at once, one with the engines' prefix cache on and one with
``shoal up --no-prefix-cache``; each round runs the same sessions on one, then
on the other (the order alternates over rounds; the idle cluster costs both the
same). Each round has sessions of its own (other system prompts), so a cache
warmed by an earlier round serves nothing. Reported per side: TTFT p50 and p99
(the time to the first chunk that carries a generated token; shoal sends the
chunk announcing the assistant's role before any token is computed, which is
not counted), on the first turn and on later turns, and the hit rate: cached
prompt tokens over prompt tokens, from ``usage.prompt_tokens_details.
cached_tokens``, else from the agents' ``/metrics`` prefix-cache counters.
Figures are medians over rounds; ``ttft_p50_ratio`` is each round's p50 without
the cache over the p50 with it, the median over rounds.

**Policies** (``--policies kv,infaas++,...``): the same sessions, one cluster per dispatch
policy (``shoal up --policy``), all with the cache; each round's order rotates; the paired
ratios are each policy's over the first's. With the torch engine the run also predicts
itself (:mod:`frontend.bench_prefix_sim`): the sessions become a trace ``shoal simulate
--trace`` replays with a profile of the torch engine measured first, and each policy's
simulated TTFT p50 is set beside the live one.

The modules: :mod:`~frontend.bench_prefix_sessions` (sessions and client),
:mod:`~frontend.bench_prefix_runner` (clusters and rounds), :mod:`~frontend.bench_prefix_report`
(figures, table, plot), :mod:`~frontend.bench_prefix_sim` (the prediction),
:mod:`~frontend.bench_prefix_vllm` (the vllm-repetition mode).

**vllm-repetition** (``--mode vllm-repetition``): ``vllm bench serve --dataset-name
prefix_repetition`` (prompts sharing one of a few prefixes) against ``shoal up
--engine vllm`` and against ``vllm serve --enable-prefix-caching``, one server
at a time, with the machinery of :mod:`frontend.bench_vllm_serve`; needs vLLM
(``./install.sh --vllm``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import click

from frontend.bench_cli import scratch_dir
from frontend.bench_prefix_runner import CACHE_SIDES, policy_sides, sessions_mode
from frontend.bench_prefix_sessions import Workload
from frontend.bench_prefix_vllm import Repetition, repetition_mode

__all__ = ["bench_prefix"]


# ---------------------------------------------------------------------------------------- the command


@click.command("prefix")
@click.option(
    "--mode",
    type=click.Choice(["sessions", "vllm-repetition"]),
    default="sessions",
    show_default=True,
    help="sessions: multi-turn chats against shoal up, cache on vs off; vllm-repetition: vllm bench "
    "serve's prefix_repetition against shoal up --engine vllm and vllm serve.",
)
@click.option(
    "--engine",
    type=click.Choice(["torch", "vllm"]),
    default="torch",
    show_default=True,
    help="sessions: the agents' engine.",
)
@click.option(
    "--model",
    default=None,
    help="sessions: the model (default: torch preset small); vllm-repetition: "
    "a checkpoint folder (default: a small random one, built here).",
)
@click.option("--instances", type=int, default=2, show_default=True, help="sessions: agents per cluster.")
@click.option("--threads", type=int, default=1, show_default=True, help="sessions: torch threads per agent.")
@click.option("--groups", type=int, default=2, show_default=True, help="System prompts (each its group).")
@click.option(
    "--sessions", "sessions_per_group", type=int, default=4, show_default=True, help="Sessions per group."
)
@click.option("--turns", type=int, default=4, show_default=True, help="Turns per session.")
@click.option("--system-words", type=int, default=160, show_default=True, help="Words of a system prompt.")
@click.option("--user-words", type=int, default=12, show_default=True, help="Words of a user message.")
@click.option("--answer-tokens", type=int, default=32, show_default=True, help="Tokens of each answer.")
@click.option("--think", type=float, default=1.0, show_default=True, help="Mean think time between turns, s.")
@click.option(
    "--rounds",
    type=int,
    default=3,
    show_default=True,
    help="Rounds (each side once per round, the first side alternating); medians are reported.",
)
@click.option("--num-prompts", type=int, default=32, show_default=True, help="vllm-repetition: prompts.")
@click.option(
    "--concurrency", type=int, default=4, show_default=True, help="vllm-repetition: max concurrency."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--ready-timeout", type=float, default=600.0, show_default=True, help="Per server start, s.")
@click.option("--run-timeout", type=float, default=600.0, show_default=True, help="Per side and round, s.")
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the servers' logs and each turn's record here (default: a temporary folder).",
)
@click.option(
    "--policies",
    default=None,
    help="sessions: compare these dispatch policies (comma-separated shoal up --policy values; the first "
    "is the reference of the paired ratios), one cluster each, all with the prefix cache; with the torch "
    "engine, also the simulator's prediction of each (shoal simulate --trace of the same sessions).",
)
@click.option(
    "--trace-out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="--policies: write the sessions trace the simulator replays here (.jsonl or .jsonl.gz; default: "
    "the log folder).",
)
@click.option(
    "--sim-profile",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="--policies: the simulator's engine profile (default: the torch engine's, measured here first).",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option(
    "--png",
    "png_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="sessions: TTFT by turn and hit rate of both sides (needs matplotlib: the bench extra).",
)
def bench_prefix(
    mode: str,
    engine: str,
    model: str | None,
    instances: int,
    threads: int,
    groups: int,
    sessions_per_group: int,
    turns: int,
    system_words: int,
    user_words: int,
    answer_tokens: int,
    think: float,
    rounds: int,
    num_prompts: int,
    concurrency: int,
    seed: int,
    ready_timeout: float,
    run_timeout: float,
    log_dir: Path | None,
    policies: str | None,
    trace_out: Path | None,
    sim_profile: Path | None,
    json_path: Path | None,
    png_path: Path | None,
) -> None:
    """TTFT and prefix-cache hit rate of multi-turn chat sessions, the cache on vs off (or, with
    --policies, dispatch policies side by side and the simulator's prediction of each).

    The defaults (8 sessions of 4 turns, 3 rounds, two clusters of 2 torch small agents) take about
    3 minutes on two cores.
    """
    if rounds < 1 or instances < 1 or threads < 1:
        raise click.UsageError("--rounds, --instances and --threads must be positive")
    sides = CACHE_SIDES
    if policies is not None:
        sides = policy_sides(policies)
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = stack.enter_context(scratch_dir("shoal-bench-prefix-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        if mode == "vllm-repetition":
            workload = Repetition(num_prompts=num_prompts, concurrency=concurrency, seed=seed)
            repetition_mode(
                log_dir,
                None if model is None else Path(model),
                workload,
                rounds,
                ready_timeout,
                run_timeout,
                json_path,
            )
            return
        if engine == "vllm" and model is None:
            raise click.UsageError("--engine vllm needs --model CHECKPOINT_FOLDER")
        try:
            sessions = Workload(
                groups, sessions_per_group, turns, system_words, user_words, answer_tokens, think, seed=seed
            )
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        sessions_mode(
            log_dir,
            engine,
            model or "small",
            instances,
            threads,
            sessions,
            rounds,
            ready_timeout,
            run_timeout,
            json_path,
            png_path,
            sides,
            trace_out,
            sim_profile,
        )
