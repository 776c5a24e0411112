"""``shoal bench engine``: the torch engine's decode tokens/s per preset and batch size, KV export/import
bandwidth next to a plain copy of the same bytes, and (``--profile-out``) a step-time profile for ``sim``.

Decode is timed on requests admitted with their KV already in place (the
migration path, ``admit_migrated``) so a batch of long sequences needs no
minutes of prefill first; KV values do not change the time of a step.
Prefill is timed separately on one prompt. Every figure is the median of
several repetitions, measured in the same process with the torch thread
count stated in the output.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from bus.bench_progress import BenchProgress

__all__ = ["bench_engine", "measure_decode_ms", "measure_kv_transfer", "measure_prefill_ms"]


def _median_s(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _engine(preset: str, num_blocks: int, max_batch_size: int, device: str, dtype: str | None) -> Any:
    from agents.engines.torch_engine import TorchEngine

    # The prefix cache off: these measure the model's compute, and a repeated prompt would be a hit.
    return TorchEngine(
        preset, num_blocks=num_blocks, max_batch_size=max_batch_size, device=device, dtype=dtype,
        prefix_cache=False,
    )


def measure_decode_ms(
    preset: str,
    batch_size: int,
    context_len: int,
    *,
    steps: int,
    device: str = "cpu",
    dtype: str | None = None,
) -> float:
    """Median ms of one decode step of ``batch_size`` sequences of ``context_len`` tokens each."""
    from schemas import SamplingParams

    block_size = 16
    per_request = -(-(context_len + steps + 8) // block_size)
    engine = _engine(preset, batch_size * per_request + 1, batch_size, device, dtype)
    sampling = SamplingParams(max_tokens=10**6, ignore_eos=True, seed=0, temperature=0.0)
    for index in range(batch_size):
        reservation = engine.reserve(per_request)
        prompt = [(index * 31 + t) % 256 for t in range(context_len - 1)]
        engine.admit_migrated(f"r{index}", prompt, [7], sampling, 0, [reservation])
    engine.step()  # warm-up
    return 1000 * _median_s(engine.step, steps)


def measure_prefill_ms(
    preset: str, prompt_len: int, *, repeats: int, device: str = "cpu", dtype: str | None = None
) -> float:
    """Median ms of a step that prefills one prompt of ``prompt_len`` tokens."""
    from schemas import SamplingParams

    engine = _engine(preset, -(-(prompt_len + 1) // 16) + 1, 1, device, dtype)
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    counter = iter(range(10**9))

    def prefill() -> None:
        engine.add_request(f"p{next(counter)}", [t % 256 for t in range(prompt_len)], sampling)
        engine.step()

    return 1000 * _median_s(prefill, repeats)


def measure_kv_transfer(
    preset: str, *, pool_blocks: int, num_blocks: int, repeats: int, seed: int = 0
) -> dict[str, float | int | str]:
    """GB/s of exporting / importing ``num_blocks`` scattered blocks vs a contiguous copy of those bytes."""
    import torch

    from agents.engines.torch_engine import PRESETS, KVPoolShape, PagedKVPool

    shape = KVPoolShape.for_model(PRESETS[preset], block_size=16, dtype="float32")
    pool = PagedKVPool(shape, pool_blocks)
    pool.pool.normal_()  # touch every page: untouched zero pages would flatter the gather
    generator = torch.Generator().manual_seed(seed)
    block_ids = torch.randperm(pool_blocks, generator=generator)[:num_blocks]
    import_ids = torch.randperm(pool_blocks, generator=generator)[:num_blocks]
    nbytes = num_blocks * shape.bytes_per_block
    buffer = torch.empty((num_blocks, *shape.block_dims))
    source = pool.rows[:num_blocks]
    target = torch.empty_like(source)
    gb = nbytes / 1e9
    timings = {
        "export_gbps": _median_s(lambda: pool.export(block_ids, out=buffer), repeats),
        "import_gbps": _median_s(lambda: pool.import_(import_ids, buffer), repeats),
        "plain_copy_gbps": _median_s(lambda: target.copy_(source), repeats),
        "export_alloc_gbps": _median_s(lambda: pool.export(block_ids), repeats),
        "plain_clone_gbps": _median_s(lambda: source.clone(), repeats),
    }
    result: dict[str, float | int | str] = {name: round(gb / seconds, 3) for name, seconds in timings.items()}
    result.update(preset=preset, num_blocks=num_blocks, bytes_per_block=shape.bytes_per_block, nbytes=nbytes)
    result["export_vs_plain"] = round(float(result["export_gbps"]) / float(result["plain_copy_gbps"]), 3)
    result["import_vs_plain"] = round(float(result["import_gbps"]) / float(result["plain_copy_gbps"]), 3)
    return result


def _write_profile(
    path: Path,
    preset: str,
    *,
    threads: int,
    steps: int,
    device: str,
    dtype: str | None,
    echo: Callable[[str], None],
) -> None:
    """Measure a decode grid and a prefill curve of ``preset`` and write a ``sim`` profile."""
    from agents.engines.profile import (
        DecodeTable,
        EngineProfile,
        PrefillTable,
        ProfileKV,
        ProfileModel,
        dump_profile,
    )
    from agents.engines.torch_engine import PRESETS

    batch_sizes = (1, 8, 32)
    longest = min(2048, PRESETS[preset].max_position_embeddings - steps - 16)
    context_axis = (1024, 4096, 16384)  # summed sequence lengths of the batch
    rows: list[tuple[float, ...]] = []
    for batch in batch_sizes:
        # Per-row line through two measured points, evaluated on the shared context axis.
        lengths = sorted({max(16, min(longest, c // batch)) for c in (context_axis[0], context_axis[-1])})
        if len(lengths) == 1:
            lengths.insert(0, max(16, longest // 8))
        points = [(batch * n, measure_decode_ms(preset, batch, n, steps=steps, device=device, dtype=dtype))
                  for n in lengths]
        (c0, t0), (c1, t1) = points[0], points[-1]
        slope = max(0.0, (t1 - t0) / (c1 - c0)) if c1 != c0 else 0.0  # more KV never makes a step faster
        rows.append(tuple(round(max(0.0, t0 + slope * (c - c0)), 3) for c in context_axis))
        echo(f"profile decode batch {batch}: " + ", ".join(f"{c} ctx {t:.1f} ms" for c, t in points))
    prefill_tokens = tuple(n for n in (16, 128, 512, 1024) if n < PRESETS[preset].max_position_embeddings)
    prefill_ms = tuple(round(measure_prefill_ms(preset, n, repeats=3, device=device, dtype=dtype), 3)
                       for n in prefill_tokens)
    engine = _engine(preset, 1, 1, device, dtype)
    info = engine.info
    profile = EngineProfile(
        name=f"torch-{preset}-{device}-{threads}t",
        description=f"shoal's torch engine, preset {preset!r}, on {device} with {threads} torch threads.",
        source=(
            f"shoal bench engine --profile-out on {platform.processor() or platform.machine()}; decode rows "
            "are lines through two measured points per batch size (pre-filled KV); prefill of one prompt"
        ),
        estimated=False,
        model=ProfileModel.of(info.model),
        kv=ProfileKV.of(info.kv_layout),
        num_blocks=max(1, 2**30 // info.bytes_per_block),
        block_size=info.block_size,
        max_batch_size=256,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_id=info.eos_token_id,
        bytes_per_block=info.bytes_per_block,
        decode=DecodeTable(batch_sizes=batch_sizes, context_tokens=context_axis, ms=tuple(rows)),
        prefill=PrefillTable(tokens=prefill_tokens, ms=prefill_ms),
    )
    dump_profile(profile, path)
    echo(f"wrote profile {profile.name!r} to {path}")


_PATH = click.Path(dir_okay=False, path_type=Path)


def _csv_ints(value: str) -> tuple[int, ...]:
    return tuple(int(part) for part in value.split(",") if part.strip())


@click.command("engine")
@click.option("--json", "json_path", type=_PATH, help="Write the results as JSON here.")
@click.option("--profile-out", type=_PATH, help="Also measure a step-time grid; write a sim profile.")
@click.option("--profile-preset", default="small", show_default=True, help="Preset the profile describes.")
@click.option("--presets", default="tiny,small,kv-heavy", show_default=True, help="Comma-separated presets.")
@click.option("--batch-sizes", default="1,8,32", show_default=True, help="Decode batch sizes.")
@click.option("--context-len", default=256, show_default=True, help="Tokens per sequence while decoding.")
@click.option("--prompt-len", default=256, show_default=True, help="Prompt tokens for the prefill figure.")
@click.option("--steps", default=8, show_default=True, help="Timed decode steps per point (median).")
@click.option("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice).")
@click.option("--kv-preset", default="kv-heavy", show_default=True, help="Preset whose KV blocks are moved.")
@click.option("--kv-pool-blocks", default=256, show_default=True, help="Blocks in the pool exported from.")
@click.option("--kv-blocks", default=64, show_default=True, help="Scattered blocks per export / import.")
@click.option("--repeats", default=7, show_default=True, help="Repetitions per bandwidth figure (median).")
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default=None, help="float32 / bfloat16 (CPU), float16 / bfloat16 (CUDA).")
def bench_engine(
    json_path: Path | None,
    profile_out: Path | None,
    profile_preset: str,
    presets: str,
    batch_sizes: str,
    context_len: int,
    prompt_len: int,
    steps: int,
    threads: int | None,
    kv_preset: str,
    kv_pool_blocks: int,
    kv_blocks: int,
    repeats: int,
    device: str,
    dtype: str | None,
) -> None:
    """Torch engine tokens/s (batch 1, 8, 32 per preset) and KV export/import GB/s vs a plain copy.

    The defaults take under a minute on two cores; more points and steps:
    --batch-sizes 1,8,32,64 --steps 32 --repeats 15; --profile-out also measures a step-time grid.
    """
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    num_threads = torch.get_num_threads()
    echo = click.echo
    echo(f"torch {torch.__version__}, device {device}, {num_threads} torch threads")
    results: dict[str, Any] = {
        "torch_version": torch.__version__,
        "device": device,
        "torch_threads": num_threads,
        "machine": platform.processor() or platform.machine(),
        "context_len": context_len,
        "decode": [],
        "prefill": [],
    }
    preset_names: Sequence[str] = [p.strip() for p in presets.split(",") if p.strip()]
    batches = _csv_ints(batch_sizes)
    progress = BenchProgress(
        "engine", len(preset_names) * (len(batches) + 1) + 1 + (profile_out is not None)
    )
    for preset in preset_names:
        for batch in batches:
            progress.phase(f"decode, preset {preset}, batch {batch}")
            ms = measure_decode_ms(preset, batch, context_len, steps=steps, device=device, dtype=dtype)
            row = {"preset": preset, "batch_size": batch, "step_ms": round(ms, 3),
                   "tokens_per_s": round(batch * 1000 / ms, 1)}
            results["decode"].append(row)
            echo(f"decode  {preset:9s} batch {batch:3d}: {ms:8.2f} ms/step {batch * 1000 / ms:9.1f} tokens/s")
        progress.phase(f"prefill, preset {preset}, {prompt_len} tokens")
        ms = measure_prefill_ms(preset, prompt_len, repeats=3, device=device, dtype=dtype)
        results["prefill"].append({"preset": preset, "prompt_tokens": prompt_len, "ms": round(ms, 3),
                                   "tokens_per_s": round(prompt_len * 1000 / ms, 1)})
        echo(f"prefill {preset:9s} {prompt_len} tokens: {ms:8.2f} ms ({prompt_len * 1000 / ms:.0f} tokens/s)")
    progress.phase(f"KV export/import, preset {kv_preset}, {kv_blocks} blocks")
    transfer = measure_kv_transfer(
        kv_preset, pool_blocks=kv_pool_blocks, num_blocks=kv_blocks, repeats=repeats
    )
    results["kv_transfer"] = transfer
    for key in ("export_gbps", "import_gbps", "plain_copy_gbps"):
        results[key] = transfer[key]
    echo(
        f"kv {kv_preset}: {kv_blocks} scattered blocks of {transfer['bytes_per_block']} B: "
        f"export {transfer['export_gbps']} GB/s, import {transfer['import_gbps']} GB/s, "
        f"plain copy {transfer['plain_copy_gbps']} GB/s (export x{transfer['export_vs_plain']}, "
        f"import x{transfer['import_vs_plain']}); allocating: export {transfer['export_alloc_gbps']} GB/s, "
        f"clone {transfer['plain_clone_gbps']} GB/s"
    )
    if profile_out is not None:
        progress.phase(f"profile of preset {profile_preset}")
        _write_profile(
            profile_out, profile_preset, threads=num_threads, steps=steps, device=device, dtype=dtype,
            echo=echo,
        )
        results["profile"] = str(profile_out)
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2) + "\n")
        echo(f"wrote {json_path}")
