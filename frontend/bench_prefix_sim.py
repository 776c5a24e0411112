"""The simulator's prediction of a live ``shoal bench prefix --policies`` run.

The live run's sessions become a sessions trace (:mod:`scheduler.sim.session_trace`): per turn
its session, round, start or think time, prompt length, answer length and the prompt's chained
block hashes (from the prompt's token ids, as the frontend's ``/tokenize`` renders the chat),
numbered 0, 1, 2, ...; the torch engine's step times are measured here, in this process
(:func:`measure_torch_profile`: one prompt's prefill, decode steps of a few batch sizes, one torch
thread as each agent has); :func:`predict` replays the trace in ``shoal simulate`` (a process of
its own) with each policy on as many instances as the live clusters had, and reports TTFT
p50/p99 and the hit rate per policy over all the trace's turns.

What the simulator does not model, and so what a gap between the two comes from: the agents
of a cluster share the machine's cores (4 agents of one torch thread on 2 cores compute at
most 2 steps at a time), and the frontend, the scheduler and NATS run on the same cores.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from agents.engines.profile import DecodeTable, EngineProfile, PrefillTable, ProfileKV, ProfileModel

__all__ = [
    "PREFILL_TOKENS",
    "SIM_POLICIES",
    "SIM_STEP_TOKENS",
    "measure_torch_profile",
    "number_blocks",
    "predict",
    "simulate_command",
    "trace_lines",
    "write_trace",
]

#: Prompt lengths whose prefill the profile measures (the sessions' prompts reach about 2,000).
PREFILL_TOKENS = (16, 256, 512, 1024, 2048)
#: Decode batch sizes and tokens per sequence the profile measures.
DECODE_BATCHES = (1, 4, 12)
DECODE_LENGTHS = (256, 2048)
#: The torch engine's per-step token budget (``TorchEngineConfig.max_step_tokens``).
SIM_STEP_TOKENS = 2048
#: A live ``--policy`` as ``shoal simulate`` runs it: ``--policy`` and ``--dispatch`` ("" for the
#: policy's own). shoal's rules bring shoal's migration and moves of queued requests, the paper's
#: freeness its migration; the others place without migrating.
SIM_POLICIES: dict[str, tuple[str, str]] = {
    "prefill_ahead": ("shoal", ""),
    "predicted_ttft": ("shoal-cost", ""),
    "freeness": ("llumnix", ""),
    "infaas++": ("infaas", ""),
    "round_robin": ("rr", ""),
    "kv": ("kv", ""),
    "prefix": ("prefix", ""),
}
_SHOAL = [sys.executable, "-c", "from frontend.cli import main; main()"]


#: A neighbour of a shared measurement: one torch thread prefilling prompts without end.
_NEIGHBOUR = (
    "import torch; torch.set_num_threads({threads}); from agents.engines.bench import measure_prefill_ms\n"
    "while True: measure_prefill_ms({model!r}, 1024, repeats=1)"
)


@contextlib.contextmanager
def _busy_neighbours(model: str, count: int, threads: int) -> Iterator[None]:
    """``count`` processes computing prefills of ``model`` beside this one, stopped at the end."""
    code = _NEIGHBOUR.format(threads=threads, model=model)
    processes = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(count)
    ]
    try:
        time.sleep(2.0 if processes else 0.0)  # past their imports and first allocations
        yield
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()


def measure_torch_profile(
    model: str, *, threads: int, echo: Callable[[str], None], neighbours: int = 0
) -> EngineProfile:
    """The torch engine's profile of ``model`` measured here with ``threads`` torch threads: prefill of
    one prompt at :data:`PREFILL_TOKENS`, decode steps at :data:`DECODE_BATCHES` x
    :data:`DECODE_LENGTHS`; its blocks as an agent's default KV space holds. ``neighbours``: that
    many processes compute prefills beside it meanwhile (a cluster's agents sharing the cores)."""
    import torch

    from agents.engines.bench import measure_decode_ms, measure_prefill_ms
    from agents.engines.torch_engine import TorchEngine

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(_busy_neighbours(model, neighbours, threads))
        info = TorchEngine(model).info  # the agents' defaults: KV space, block size
        lengths = tuple(n for n in PREFILL_TOKENS if n < info.max_model_len)
        repeats = 5 if neighbours else 3  # time slices shared with neighbours spread the steps more
        prefill = tuple(round(measure_prefill_ms(model, n, repeats=repeats), 3) for n in lengths)
        shown = ", ".join(f"{n} tok {ms:.0f} ms" for n, ms in zip(lengths, prefill, strict=True))
        echo(f"profile prefill: {shown}")
        short, long = DECODE_LENGTHS
        per_sequence = (min(short, info.max_model_len // 4), min(long, info.max_model_len // 2))
        contexts = sorted({b * n for b in DECODE_BATCHES for n in per_sequence})
        rows = []
        for batch in DECODE_BATCHES:
            points = [(batch * n, measure_decode_ms(model, batch, n, steps=8)) for n in per_sequence]
            (c0, t0), (c1, t1) = points
            slope = max(0.0, (t1 - t0) / (c1 - c0))
            rows.append(tuple(round(max(0.0, t0 + slope * (c - c0)), 3) for c in contexts))
            echo(f"profile decode batch {batch}: " + ", ".join(f"{c} ctx {t:.1f} ms" for c, t in points))
    finally:
        stack.close()
        torch.set_num_threads(previous)
    beside = f", {neighbours} busy neighbours" if neighbours else ""
    return EngineProfile(
        name=f"torch-{model}-cpu-{threads}t" + (f"-shared{neighbours + 1}" if neighbours else ""),
        description=f"shoal's torch engine, preset {model!r}, on CPU with {threads} torch thread(s){beside}.",
        source="shoal bench prefix --policies: prefill of one prompt; decode rows are lines through two "
        "measured points per batch size",
        estimated=False,
        model=ProfileModel.of(info.model),
        kv=ProfileKV.of(info.kv_layout),
        num_blocks=info.num_blocks,
        block_size=info.block_size,
        max_batch_size=info.max_batch_size,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_id=info.eos_token_id,
        bytes_per_block=info.bytes_per_block,
        decode=DecodeTable(batch_sizes=DECODE_BATCHES, context_tokens=tuple(contexts), ms=tuple(rows)),
        prefill=PrefillTable(tokens=lengths, ms=prefill),
    ).validate()


def number_blocks(chains: Sequence[Sequence[int]]) -> list[list[int]]:
    """Block-hash chains renumbered 0, 1, 2, ... in order of first appearance (equal hash, equal id):
    the short ids a sessions trace stores."""
    ids: dict[int, int] = {}
    return [[ids.setdefault(h, len(ids)) for h in chain] for chain in chains]


def trace_lines(turns: Sequence[Mapping[str, Any]]) -> list[str]:
    """A sessions trace (:mod:`scheduler.sim.session_trace`): ``turns`` as JSON lines, each turn's
    ``chain`` (its prompt's block hashes) stored as short ``hash_ids``."""
    numbered = number_blocks([t["chain"] for t in turns])
    lines = []
    for turn, ids in zip(turns, numbered, strict=True):
        row = {key: value for key, value in turn.items() if key != "chain"}
        lines.append(json.dumps({**row, "hash_ids": ids}, separators=(",", ":")))
    return lines


def write_trace(turns: Sequence[Mapping[str, Any]], path: Path) -> None:
    """:func:`trace_lines` written to ``path`` (gzip when it ends in ``.gz``)."""
    text = "".join(line + "\n" for line in trace_lines(turns))
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text)


def simulate_command(
    policy: str, trace: Path, profile: Path, instances: int, json_path: Path, cores: int | None = None
) -> list[str]:
    """``shoal simulate`` replaying ``trace`` with the simulator's setup of the live ``--policy``
    (``cores``: the instances share that many CPU cores)."""
    name, dispatch = SIM_POLICIES.get(policy, ("infaas", policy))
    command = [
        *_SHOAL,
        "simulate",
        "--policy",
        name,
        "--trace",
        str(trace),
        "--profile",
        str(profile),
        "--instances",
        str(instances),
        "--max-step-tokens",
        str(SIM_STEP_TOKENS),
        "--prefix-cache",
        "--quiet",
        "--json",
        str(json_path),
    ]
    command += ["--dispatch", dispatch] if dispatch else []
    return command + ([] if cores is None else ["--cores", str(cores)])


def predict(
    trace: Path,
    profile: Path,
    policies: Sequence[str],
    instances: int,
    work_dir: Path,
    timeout_s: float,
    cores: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Per policy, ``shoal simulate`` of the whole trace (``cores``: the instances sharing that many
    CPU cores): TTFT p50 and p99 (ms), the hit rate, the command. A run that fails gives its error
    instead."""
    predicted: dict[str, dict[str, Any]] = {}
    for policy in policies:
        out = work_dir / f"sim-{policy}.json"
        command = simulate_command(policy, trace, profile, instances, out, cores)
        finished = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        shown = ["shoal", *command[len(_SHOAL) :]]
        if finished.returncode != 0:
            predicted[policy] = {"error": finished.stderr[-1000:], "command": shown}
            continue
        result = json.loads(out.read_text())
        predicted[policy] = {
            "ttft_p50_ms": 1000 * float(result["ttft_p50_s"]),
            "ttft_p99_ms": 1000 * float(result["ttft_p99_s"]),
            "hit_rate": result.get("prefix_cache_hit_rate"),
            "requests": result.get("num_requests"),
            "command": shown,
        }
    return predicted
