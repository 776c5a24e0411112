"""``shoal bench step``: CPU time of the torch engine's steps, this checkout beside an older one.

What ``vllm bench serve`` sees of the built-in engine is mostly two numbers:
the compute of a step that prefills a burst of arrivals next to the running
decodes (the first tokens wait for it), and the compute of a decode step (every
token waits for it). Both are measured here on the same checkpoint and with
one torch thread, as CPU time of this process (``time.process_time``: what
other jobs on a shared machine do changes it far less than wall time):

* ``prefill_us_per_token``: ``--prompts`` prompts of ``--prompt-len`` tokens
  arrive at once and are prefilled with nothing else running, CPU per prompt
  token over the steps until each has its first token;
* ``burst_us_per_token``: the same burst while ``--decodes`` requests decode
  (their tokens of those steps included, as one serving step computes them);
* ``decode_step_ms``: one step of the ``--decodes`` running requests;
* ``burst_steps``: steps until the burst's last first token (the step budget,
  ``max_step_tokens``, decides it).

Each figure is also given as the least CPU of any repeat (``..._min``): on a
shared machine other jobs' use of caches and memory bandwidth still inflates
CPU time, and the minimum is what they inflate least.

With ``--baseline DIR`` (a checkout of an older commit, e.g. ``git archive
COMMIT | tar -x -C DIR``) that checkout's ``TorchEngine`` is imported under
the same names in this process and the two alternate ``--rounds`` times, so
both see the same machine; each engine runs with its own defaults unless
``--step-tokens`` sets the budget for both. The greedy tokens of a fixed mixed
workload (staggered arrivals of different lengths, decoding) are compared
between the two: ``tokens_identical``. Figures are medians over rounds; the
load average is recorded with them.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from bus.bench_progress import BenchProgress

__all__ = ["bench_step", "greedy_tokens", "load_engine_class", "measure_steps"]

_FIGURES = ("prefill_us_per_token", "burst_us_per_token", "decode_step_ms", "burst_steps")


def load_engine_class(checkout: Path | None) -> Callable[..., Any]:
    """``TorchEngine`` of this checkout, or of ``checkout``'s ``agents`` package imported beside it."""
    from agents.engines.torch_engine import TorchEngine

    if checkout is None:
        return TorchEngine

    def ours(name: str) -> bool:
        return name == "agents" or name.startswith("agents.")

    saved = {name: module for name, module in sys.modules.items() if ours(name)}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(checkout))
    try:
        engine_class: Callable[..., Any] = importlib.import_module("agents.engines.torch_engine").TorchEngine
    finally:
        sys.path.remove(str(checkout))
        for name in [name for name in sys.modules if ours(name)]:
            del sys.modules[name]
        sys.modules.update(saved)
    return engine_class


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(length)]


def _cpu(run: Callable[[], object]) -> float:
    started = time.process_time()
    run()
    return time.process_time() - started


def measure_steps(
    engine_class: Callable[..., Any],
    model: str,
    *,
    dtype: str | None,
    decodes: int,
    prompts: int,
    prompt_len: int,
    repeats: int,
    step_tokens: int | None,
) -> dict[str, float]:
    """One run of the workloads in the module docstring; medians over ``repeats``."""
    from schemas import SamplingParams

    budget: dict[str, Any] = {}
    if step_tokens is not None:
        budget = {"max_step_tokens": step_tokens, "max_pass_tokens": step_tokens}
    gc.collect()  # the previous run's engine and its KV pool go first
    engine = engine_class(model, dtype=dtype, **budget)  # the KV pool a server gets (256 MiB)
    vocab = engine.model_config.vocab_size
    sampling = SamplingParams(max_tokens=10**6, ignore_eos=True, temperature=0.0)
    rng = random.Random(0)
    counter = iter(range(10**9))

    def burst() -> tuple[float, int]:
        """CPU seconds and steps until each of ``prompts`` new prompts has its first token."""
        ids = [f"p{next(counter)}" for _ in range(prompts)]
        for request_id in ids:
            engine.add_request(request_id, _prompt(rng, prompt_len, vocab), sampling)
        waiting, cpu, steps = set(ids), 0.0, 0
        while waiting:
            started = time.process_time()
            result = engine.step()
            cpu += time.process_time() - started
            steps += 1
            waiting -= {output.request_id for output in result.outputs if output.token_ids}
        for request_id in ids:
            engine.abort(request_id)
        return cpu, steps

    burst()  # warm-up
    alone = [burst()[0] for _ in range(repeats)]
    for index in range(decodes):
        engine.add_request(f"d{index}", _prompt(rng, prompt_len, vocab), sampling)
    for _ in range(-(-decodes * prompt_len // (step_tokens or 1024)) + 3):
        engine.step()
    decode = [_cpu(engine.step) for _ in range(repeats)]
    mixed = [burst() for _ in range(repeats)]
    tokens = prompts * prompt_len
    return {
        "prefill_us_per_token": 1e6 * statistics.median(alone) / tokens,
        "burst_us_per_token": 1e6 * statistics.median(cpu for cpu, _ in mixed) / tokens,
        "decode_step_ms": 1e3 * statistics.median(decode),
        "burst_steps": statistics.median(steps for _, steps in mixed),
        # the least CPU of any repeat: what contention for caches and memory on a shared machine adds least to
        "prefill_us_per_token_min": 1e6 * min(alone) / tokens,
        "burst_us_per_token_min": 1e6 * min(cpu for cpu, _ in mixed) / tokens,
        "decode_step_ms_min": 1e3 * min(decode),
    }


def greedy_tokens(engine_class: Callable[..., Any], model: str, *, dtype: str | None) -> dict[str, list[int]]:
    """Greedy tokens of a fixed mixed workload at the engine's defaults (arrivals while others decode)."""
    from schemas import SamplingParams

    engine = engine_class(model, dtype=dtype)
    vocab = engine.model_config.vocab_size
    longest = engine.info.max_model_len - 48
    rng = random.Random(1)
    tokens: dict[str, list[int]] = {}
    for wave in range(4):
        for index in range(6):
            request_id = f"w{wave}r{index}"
            length = min(rng.choice((5, 60, 256, 700)), longest)
            max_tokens = rng.choice((8, 24, 48))
            sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
            engine.add_request(request_id, _prompt(rng, length, vocab), sampling)
            tokens[request_id] = []
        for _ in range(3 + wave):
            for output in engine.step().outputs:
                tokens[output.request_id].extend(output.token_ids)
    while engine.has_unfinished():
        for output in engine.step().outputs:
            tokens[output.request_id].extend(output.token_ids)
    return tokens


@contextlib.contextmanager
def _checkpoint(model: str | None) -> Iterator[str]:
    if model is not None:
        yield model
        return
    from agents.engines.vllm_engine.checkpoint import build_checkpoint

    with tempfile.TemporaryDirectory(prefix="shoal-bench-step-") as folder:
        yield str(build_checkpoint(Path(folder) / "checkpoint"))


@click.command("step")
@click.option(
    "--model",
    default=None,
    help="Checkpoint folder or torch preset (default: the small random Llama `bench vllm-serve` serves).",
)
@click.option("--dtype", "dtypes", multiple=True, help="Engine dtype(s) (default: the engine's own).")
@click.option("--baseline", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="A checkout of an older commit whose torch engine is measured alternately with this one.")
@click.option("--prompts", type=int, default=4, show_default=True, help="Prompts arriving at once.")
@click.option("--prompt-len", type=int, default=256, show_default=True)
@click.option("--decodes", type=int, default=32, show_default=True, help="Requests decoding meanwhile.")
@click.option("--step-tokens", type=int, default=None,
              help="max_step_tokens (and max_pass_tokens) for both engines (default: each its own).")
@click.option("--repeats", type=int, default=5, show_default=True, help="Repeats per run (median).")
@click.option("--rounds", type=int, default=3, show_default=True, help="Alternating runs per engine.")
@click.option("--threads", type=int, default=1, show_default=True, help="Torch threads.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_step(
    model: str | None,
    dtypes: tuple[str, ...],
    baseline: Path | None,
    prompts: int,
    prompt_len: int,
    decodes: int,
    step_tokens: int | None,
    repeats: int,
    rounds: int,
    threads: int,
    json_path: Path | None,
) -> None:
    """CPU time per prompt token and per decode step of the torch engine (vs --baseline).

    The defaults take under a minute on two cores; tighter medians: --rounds 7 --repeats 9.
    """
    import torch

    torch.set_num_threads(threads)
    engines = {"now": load_engine_class(None)}
    if baseline is not None:
        engines = {"baseline": load_engine_class(baseline), **engines}
    variants = [(name, dtype) for dtype in (dtypes or (None,)) for name in engines]
    load_before = os.getloadavg()
    with _checkpoint(model) as checkpoint:
        identical: dict[str, bool] = {}
        if baseline is not None:
            for dtype in dtypes or (None,):
                before, now = (greedy_tokens(engines[name], checkpoint, dtype=dtype) for name in engines)
                identical[str(dtype or "default")] = before == now
        samples: dict[tuple[str, str | None], list[dict[str, float]]] = {v: [] for v in variants}
        progress = BenchProgress("step", rounds * len(variants))
        for index in range(rounds):
            for name, dtype in variants:
                progress.phase(f"round {index + 1}/{rounds}: {name} engine, dtype {dtype or 'default'}")
                samples[name, dtype].append(
                    measure_steps(
                        engines[name], checkpoint, dtype=dtype, decodes=decodes, prompts=prompts,
                        prompt_len=prompt_len, repeats=repeats, step_tokens=step_tokens,
                    )
                )  # fmt: skip
    results: dict[str, Any] = {}
    click.echo(
        f"{prompts} x {prompt_len}-token prompts, {decodes} decodes, torch threads {threads}; "
        f"CPU time, medians of {rounds} rounds x {repeats} repeats"
    )
    click.echo(
        f"{'engine':>20} {'prefill us/tok':>15} {'burst us/tok':>13} "
        f"{'decode step ms':>15} {'burst steps':>12}"
    )
    for (name, dtype), runs in samples.items():
        key = f"{name}/{dtype or 'default'}"
        row = {figure: statistics.median(run[figure] for run in runs) for figure in _FIGURES}
        row.update({f"{figure}_min": min(run[f"{figure}_min"] for run in runs) for figure in _FIGURES[:3]})
        results[key] = {**row, "rounds": runs}
        click.echo(
            f"{key:>20} {row['prefill_us_per_token']:>15.2f} {row['burst_us_per_token']:>13.2f} "
            f"{row['decode_step_ms']:>15.2f} {row['burst_steps']:>12.0f}"
        )
    click.echo("least CPU of any repeat (what contention adds least to):")
    for key, row in results.items():
        click.echo(
            f"{key:>20} {row['prefill_us_per_token_min']:>15.2f} {row['burst_us_per_token_min']:>13.2f} "
            f"{row['decode_step_ms_min']:>15.2f}"
        )
    for dtype, same in identical.items():
        click.echo(f"greedy tokens, {dtype}: {'identical to' if same else 'DIFFERENT from'} the baseline's")
    meta = {
        "model": model or "vllm_engine.checkpoint (random Llama, 2 layers, hidden 128)",
        "baseline": str(baseline) if baseline is not None else None,
        "prompts": prompts,
        "prompt_len": prompt_len,
        "decodes": decodes,
        "step_tokens": step_tokens,
        "repeats": repeats,
        "rounds": rounds,
        "threads": threads,
        "cpus": os.cpu_count(),
        "machine": platform.platform(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    if json_path is not None:
        payload = {"meta": meta, "tokens_identical": identical, "results": results}
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
        click.echo(f"wrote {json_path}")
