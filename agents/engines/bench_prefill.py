"""``shoal bench prefill``: how long a long prompt holds up a running batch, whole vs chunked prefill.

A torch engine decodes ``--decodes`` requests; then one prompt of
``--prompt-tokens`` arrives. Each variant of ``max_step_tokens`` (``none``: the
whole prompt in one step; numbers: a step budget, the prompt prefilled in chunks)
runs the same workload, the variants alternating ``--rounds`` times in this
process so that each sees the same background load. Reported per variant
(medians over the rounds):

* ``longest_step_ms``: the longest step while the prompt is prefilled: how long
  the running batch (and, for an inline step, the agent's event loop) waits;
* ``decode_gap_p50_ms`` / ``decode_gap_max_ms``: time between two tokens of a
  running request while the prompt is prefilled;
* ``prompt_ttft_ms``: from the prompt's arrival to its first token;
* ``prefill_steps``: steps until the prompt's first token;
* ``longest_step_cpu_ms`` / ``prompt_cpu_ms``: the same in CPU time of this
  thread (torch computes on it with one thread), which hardly depends on what
  else runs on the machine.

Wall-clock figures depend on the machine's load: compare variants within one
run; the load average is recorded with them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import click

from bus.bench_progress import BenchProgress

__all__ = ["bench_prefill", "measure_prefill_stall"]


def measure_prefill_stall(
    preset: str, *, max_step_tokens: int | None, decodes: int, prompt_tokens: int, warm_steps: int = 3
) -> dict[str, Any]:
    """One run: ``decodes`` running requests, then a ``prompt_tokens`` prompt; see the module docstring."""
    from agents.engines.torch_engine import TorchEngine
    from schemas import SamplingParams

    block_size = 16
    per_decode = -(-(32 + warm_steps + prompt_tokens + 8) // block_size)  # room for a step per prompt token
    num_blocks = decodes * per_decode + -(-(prompt_tokens + 8) // block_size) + 8
    engine = TorchEngine(
        preset,
        num_blocks=num_blocks,
        block_size=block_size,
        max_batch_size=decodes + 1,
        max_model_len=prompt_tokens + 64,
        max_step_tokens=max_step_tokens,
    )
    sampling = SamplingParams(max_tokens=10**5, ignore_eos=True, temperature=0.0)
    for index in range(decodes):
        engine.add_request(f"d{index}", [(index * 7 + t) % 200 + 1 for t in range(32)], sampling)
    for _ in range(warm_steps):
        engine.step()
    last_token: dict[str, float] = dict.fromkeys((f"d{i}" for i in range(decodes)), time.perf_counter())
    engine.add_request(
        "long", [(t * 13) % 250 + 1 for t in range(prompt_tokens)], SamplingParams(max_tokens=1)
    )
    arrived = time.perf_counter()
    steps: list[float] = []
    cpu_steps: list[float] = []
    gaps: list[float] = []
    ttft = float("nan")
    while "long" in engine.scheduler:
        cpu_started = time.thread_time()
        result = engine.step()
        cpu_steps.append(time.thread_time() - cpu_started)
        now = time.perf_counter()
        steps.append(result.duration_s)
        for output in result.outputs:
            if output.request_id == "long":
                ttft = now - arrived
            elif output.request_id in last_token:
                gaps.append(now - last_token[output.request_id])
                last_token[output.request_id] = now
    return {
        "longest_step_ms": 1e3 * max(steps),
        "decode_gap_p50_ms": 1e3 * statistics.median(gaps) if gaps else float("nan"),
        "decode_gap_max_ms": 1e3 * max(gaps) if gaps else float("nan"),
        "prompt_ttft_ms": 1e3 * ttft,
        "prefill_steps": float(len(steps)),
        "longest_step_cpu_ms": 1e3 * max(cpu_steps),
        "prompt_cpu_ms": 1e3 * sum(cpu_steps),
        "step_ms": [round(1e3 * s, 3) for s in steps],
        "step_cpu_ms": [round(1e3 * s, 3) for s in cpu_steps],
    }


def _variant(text: str) -> int | None:
    return None if text.strip().lower() == "none" else int(text)


@click.command("prefill")
@click.option("--preset", default="small", show_default=True, help="Torch preset of the engine.")
@click.option("--prompt-tokens", type=int, default=3072, show_default=True, help="The long prompt.")
@click.option("--decodes", type=int, default=8, show_default=True, help="Requests decoding meanwhile.")
@click.option(
    "--step-tokens",
    default="none,1024,256",
    show_default=True,
    help="max_step_tokens variants, comma-separated ('none': whole prompt in one step).",
)
@click.option("--rounds", type=int, default=3, show_default=True, help="Alternating runs per variant.")
@click.option("--threads", type=int, default=1, show_default=True, help="Torch threads.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the step CPU times of each variant's median run as a PNG.",
)
def bench_prefill(
    preset: str,
    prompt_tokens: int,
    decodes: int,
    step_tokens: str,
    rounds: int,
    threads: int,
    json_path: Path | None,
    plot_path: Path | None,
) -> None:
    """How long a long prompt holds up running decodes: whole prefill vs chunked prefill.

    The defaults take under a minute on two cores; tighter medians: --rounds 7.
    """
    import torch

    torch.set_num_threads(threads)
    variants = [_variant(v) for v in step_tokens.split(",") if v.strip()]
    runs: dict[str, list[dict[str, Any]]] = {str(v): [] for v in variants}
    load_before = os.getloadavg()
    progress = BenchProgress("prefill", rounds * len(variants))
    for index in range(rounds):
        for variant in variants:
            budget = "whole prompt" if variant is None else f"max_step_tokens {variant}"
            progress.phase(f"round {index + 1}/{rounds}: {budget}, a {prompt_tokens}-token prompt")
            runs[str(variant)].append(
                measure_prefill_stall(
                    preset, max_step_tokens=variant, decodes=decodes, prompt_tokens=prompt_tokens
                )
            )
    results: dict[str, Any] = {}
    click.echo(
        f"preset {preset}, {decodes} decoding requests, a {prompt_tokens}-token prompt arrives; "
        f"torch threads {threads}, {os.cpu_count()} CPUs; medians of {rounds} rounds"
    )
    click.echo(
        f"{'max_step_tokens':>16} {'longest step ms':>16} {'gap p50 ms':>11} {'gap max ms':>11} "
        f"{'prompt TTFT ms':>15} {'steps':>6} {'longest step CPU ms':>20} {'prompt CPU ms':>14}"
    )
    for key, samples in runs.items():
        row = {
            name: statistics.median(s[name] for s in samples)
            for name in (
                "longest_step_ms",
                "decode_gap_p50_ms",
                "decode_gap_max_ms",
                "prompt_ttft_ms",
                "prefill_steps",
                "longest_step_cpu_ms",
                "prompt_cpu_ms",
            )
        }
        median_run = sorted(samples, key=lambda s: s["decode_gap_max_ms"])[len(samples) // 2]
        row["step_ms_of_median_run"] = median_run["step_ms"]
        row["step_cpu_ms_of_median_run"] = median_run["step_cpu_ms"]
        results[key] = row
        click.echo(
            f"{key:>16} {row['longest_step_ms']:>16.1f} {row['decode_gap_p50_ms']:>11.1f} "
            f"{row['decode_gap_max_ms']:>11.1f} {row['prompt_ttft_ms']:>15.1f} {row['prefill_steps']:>6.0f} "
            f"{row['longest_step_cpu_ms']:>20.1f} {row['prompt_cpu_ms']:>14.1f}"
        )
    meta = {
        "preset": preset,
        "prompt_tokens": prompt_tokens,
        "decodes": decodes,
        "rounds": rounds,
        "threads": threads,
        "cpus": os.cpu_count(),
        "machine": platform.platform(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
    }
    if json_path is not None:
        json_path.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
        click.echo(f"wrote {json_path}")
    if plot_path is not None:
        _plot(results, meta, plot_path)
        click.echo(f"wrote {plot_path}")


def _plot(results: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 3.5))
    for key, row in results.items():
        steps = row["step_cpu_ms_of_median_run"]
        ends = [sum(steps[: i + 1]) for i in range(len(steps))]
        label = "whole prompt in one step" if key == "None" else f"chunked, {key} tokens per step"
        axes.step([0.0, *ends], [steps[0], *steps], where="pre", label=label)
    axes.set_xlabel("CPU ms since the prompt arrived")
    axes.set_ylabel("step CPU ms (decodes wait this long)")
    axes.set_title(f"{meta['decodes']} decodes + a {meta['prompt_tokens']}-token prompt ({meta['preset']})")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
