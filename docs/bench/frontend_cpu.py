"""The frontend's CPU per request, frontends of several source trees side by side on one cluster.

One embedded NATS, ``shoal scheduler`` and one ``shoal agent --engine sim`` (a timing profile
with the small random Llama checkpoint's 512-token vocabulary, so the engine costs nothing
but its modeled step), and one ``shoal serve`` per ``--variant NAME=SOURCE_TREE`` (its
``PYTHONPATH``), each with the checkpoint's tokenizer. Every round runs the same load against
each frontend in turn (the order alternates): ``--num`` completions of a ``--prompt``-token
text prompt and ``--max-tokens`` output tokens (``ignore_eos``), ``--concurrency`` at a time,
streamed and then whole, from aiohttp clients in this process. Reported: each process's CPU
(user + system, from ``/proc``) over the run divided by the requests, and the medians.

    python docs/bench/frontend_cpu.py --variant base=/tmp/base --variant new=. --rounds 4

A source tree for an earlier commit: ``git archive COMMIT | tar -x -C /tmp/base``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bus.server import EmbeddedNats, free_port  # noqa: E402

SHOAL = [sys.executable, "-c", "from frontend.cli import main; main()"]
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def health(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1.0) as response:
            body: dict[str, Any] = json.loads(response.read())
            return body
    except urllib.error.HTTPError as error:  # 503 until ready: its body says why
        try:
            body = json.loads(error.read())
            return body
        except ValueError:
            return None
    except (OSError, ValueError):
        return None


def build_inputs(folder: Path) -> tuple[Path, Path]:
    """The checkpoint (for its tokenizer) and a sim profile of its vocabulary."""
    from agents.engines.vllm_engine.checkpoint import build_checkpoint

    checkpoint = Path(build_checkpoint(folder / "checkpoint"))
    profile = json.loads((ROOT / "agents/engines/profiles/llama-7b-a10.json").read_text())
    profile.update(name="frontend-cpu", vocab_size=512, eos_token_id=1, num_blocks=8192, max_model_len=2048)
    path = folder / "profile.json"
    path.write_text(json.dumps(profile))
    return checkpoint, path


def prompts(checkpoint: Path, count: int, length: int) -> list[str]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    rng = random.Random(0)
    return [tokenizer.decode([rng.randrange(3, 512) for _ in range(length)]) for _ in range(count)]


async def one(session: Any, url: str, model: str, prompt: str, max_tokens: int, stream: bool) -> None:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for _ in response.content.iter_any():
            pass


async def load(
    url: str, model: str, texts: list[str], concurrency: int, max_tokens: int, stream: bool
) -> float:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as session:
        queue = list(texts)

        async def worker() -> None:
            while queue:
                await one(session, url, model, queue.pop(), max_tokens, stream)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=SOURCE_TREE")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--time-scale", type=float, default=0.5, help="the sim engine's step time multiplier")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    variants = [tuple(v.split("=", 1)) for v in args.variant]
    modes = ("stream", "whole")
    work = Path(tempfile.mkdtemp(prefix="frontend-cpu-"))
    checkpoint, profile = build_inputs(work)
    model = str(checkpoint)
    children: list[subprocess.Popen[bytes]] = []
    nats = EmbeddedNats(store_dir=work / "nats-store", die_with_parent=True).start()

    def spawn(name: str, argv: list[str], source: str = str(ROOT)) -> int:
        with open(work / f"{name}.log", "ab") as log:
            child = subprocess.Popen(
                [*SHOAL, *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=work,
                env={**os.environ, "PYTHONPATH": os.path.abspath(source)},
                start_new_session=True,
            )
        children.append(child)
        return child.pid

    try:
        pids = {
            "nats": nats.pid or 0,
            "scheduler": spawn("scheduler", ["scheduler", "--nats", nats.url, "--log-level", "WARNING"]),
            "agent": spawn(
                "agent",
                [
                    "agent",
                    "--nats",
                    nats.url,
                    "--instance-id",
                    "a0",
                    "--engine",
                    "sim",
                    "--profile",
                    str(profile),
                    "--time-scale",
                    str(args.time_scale),
                    "--transport",
                    "tcp",
                    "--log-level",
                    "WARNING",
                ],
            ),
        }
        urls = {}
        for name, source in variants:
            port = free_port()
            pids[f"frontend-{name}"] = spawn(
                f"frontend-{name}",
                [
                    "serve",
                    "--nats",
                    nats.url,
                    "--model",
                    model,
                    "--port",
                    str(port),
                    "--max-model-len",
                    "2048",
                ],
                source,
            )
            urls[name] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        for name, url in urls.items():
            while not ((h := health(url)) and h.get("instances")):
                if time.monotonic() > deadline:
                    raise SystemExit(f"frontend {name} did not get ready; logs in {work}")
                time.sleep(0.3)
        texts = prompts(checkpoint, args.num, args.prompt)
        for url in urls.values():  # warm up: connections, first compilations
            for stream in (True, False):
                asyncio.run(load(url, model, texts[: args.concurrency], args.concurrency, 4, stream))
        runs: dict[str, dict[str, list[dict[str, float]]]] = {n: {m: [] for m in modes} for n, _ in variants}
        for round_ in range(args.rounds):
            for mode in modes:
                for name, _ in variants if round_ % 2 == 0 else variants[::-1]:
                    watched = {k: p for k, p in pids.items() if not k.startswith("frontend-")}
                    watched["frontend"] = pids[f"frontend-{name}"]
                    before = {k: cpu_seconds(p) for k, p in watched.items()}
                    wall = asyncio.run(
                        load(urls[name], model, texts, args.concurrency, args.max_tokens, mode == "stream")
                    )
                    row = {k: 1000 * (cpu_seconds(p) - before[k]) / args.num for k, p in watched.items()}
                    row["wall_s"] = wall
                    runs[name][mode].append(row)
                    print(
                        f"round {round_} {mode:6} {name:10} frontend {row['frontend']:.2f} ms/request "
                        f"(scheduler {row['scheduler']:.2f}, agent {row['agent']:.2f}, "
                        f"nats {row['nats']:.2f})",
                        flush=True,
                    )
        summary = {
            f"{name}/{mode}": {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            for name in runs
            for mode, rows in runs[name].items()
        }
        print("medians, CPU ms per request:")
        for key, med in summary.items():
            print(
                f"  {key:18} frontend {med['frontend']:.2f}  scheduler {med['scheduler']:.2f}  "
                f"agent {med['agent']:.2f}  nats {med['nats']:.2f}"
            )
        if args.json is not None:
            args.json.write_text(
                json.dumps(
                    {"args": vars(args) | {"json": str(args.json)}, "runs": runs, "medians": summary},
                    indent=1,
                )
            )
    finally:
        for child in children:
            try:
                os.killpg(child.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        for child in children:
            try:
                child.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
        nats.stop()
    shutil.rmtree(work, ignore_errors=True)  # kept when the run failed, for the logs


if __name__ == "__main__":
    main()
