"""``shoal up --engine vllm`` as a user runs it, with the official openai client.

The cluster (embedded NATS, scheduler, one or two agents each with an
in-process vLLM engine on the small random Llama checkpoint, the frontend)
serves completions and chat, streaming and not, with the checks of
``test_openai_e2e``: streamed text equals the non-streamed text, usage counts,
finish reasons, stop strings; concurrent greedy streams all give the text of a
single one. SIGINT stops everything and leaves no process behind. Skipped
(with the reason) where vLLM is not installed.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from agents.engines.vllm_engine import vllm_unavailable_reason
from agents.engines.vllm_engine.checkpoint import build_checkpoint
from agents.engines.vllm_engine.cpu_binding import parse_cpu_list, physical_cores, split_for_instances
from bus.server import free_port
from tests.processes import alive

_REASON = vllm_unavailable_reason()
pytestmark = [
    pytest.mark.slow, pytest.mark.e2e, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
]

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("llama"))


@pytest.fixture
def shoal_up(checkpoint: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[int, str]]:
    """``shoal up --engine vllm`` with ``request.param`` instances; yields (port, model name)."""
    port = free_port()
    # one instance: shoal up's own KV size on CPU (1 GiB; vLLM's would be 90% of RAM); two: 64 MiB each
    kv_bytes = [] if request.param == 1 else ["--kv-cache-bytes", str(64 * 2**20)]
    scratch = tmp_path / "tmp"  # the processes' temporary folder: nothing of theirs may stay there
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env |= {"TMPDIR": str(scratch), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    process = subprocess.Popen(
        [sys.executable, "-c", "from frontend.cli import main; main()", "up", "--engine", "vllm",
         "--model", str(checkpoint), "--instances", str(request.param), "--port", str(port),
         *kv_bytes, "--max-model-len", "1024",
         "--log-dir", str(tmp_path / "logs"), "--ready-timeout", "240"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    assert process.stdout is not None
    pids: dict[str, int] = {}
    lines: list[str] = []
    try:
        for line in process.stdout:
            lines.append(line.rstrip())
            found = re.search(r"^(\S+)\s+(?:(agent-\d+) )?pid (\d+)", line)
            if found:
                pids[found.group(2) or found.group(1)] = int(found.group(3))
            embedded = re.search(r"embedded, pid (\d+)", line)
            if embedded:
                pids["nats-server"] = int(embedded.group(1))
            if line.startswith("shoal is serving"):
                break
        else:
            raise AssertionError("shoal up did not become ready:\n" + "\n".join(lines))
        assert {f"agent-{i}" for i in range(request.param)} | {"nats-server", "frontend"} <= set(pids)
        defaulted = any(line.startswith("kv cache        1 GiB per agent") for line in lines)
        assert defaulted == (request.param == 1)
        # each agent's model thread is pinned to its own share of the CPUs (vLLM's CPU binding, in-process)
        allowed = sorted(os.sched_getaffinity(0))
        binds = split_for_instances(allowed, request.param, env, physical_cores(allowed))
        assert f"cpu binding     vllm model thread CPUs per agent: {' / '.join(binds)}" in lines
        for index, bind in enumerate(binds):
            agent_log = (tmp_path / "logs" / f"agent-{index}.log").read_text()
            if bind != "nobind":
                cpus = list(parse_cpu_list(bind))
                assert f"model thread pinned to CPUs {cpus} with {len(cpus)} torch thread(s)" in agent_log
        yield port, str(checkpoint)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        finally:
            process.stdout.close()
    time.sleep(0.5)
    _print_log_tails(tmp_path / "logs")  # shown by pytest when the test failed
    assert not [name for name, pid in pids.items() if alive(pid)], "a child outlived shoal up"
    assert not list(scratch.iterdir())  # vLLM's own leftovers (vllm_dist_*) went with their agent


def _print_log_tails(folder: Path, lines: int = 25) -> None:
    for log in sorted(folder.glob("*.log")):
        kept = [line for line in log.read_text(errors="replace").splitlines()
                if "leaked" not in line and "nanobind" not in line and not line.startswith(" - ")]
        print(f"--- {log.name} (last {lines} lines) ---", *kept[-lines:], sep="\n")


async def _stream_text(client: Any, model: str, **kwargs: Any) -> tuple[str, list[str], Any]:
    parts: list[str] = []
    finish: list[str] = []
    usage = None
    stream = await client.completions.create(model=model, prompt=PROMPT, stream=True,
                                             stream_options={"include_usage": True}, **kwargs)
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.text)
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    return "".join(parts), finish, usage


@pytest.mark.parametrize("shoal_up", [1, 2], indirect=True, ids=["1-instance", "2-instances"])
async def test_shoal_up_vllm_serves_the_openai_client(shoal_up: tuple[int, str]) -> None:
    port, model = shoal_up
    async with openai.AsyncOpenAI(api_key="x", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0,
                                  timeout=120) as client:
        # completions: streaming and not agree, usage counts
        plain = await client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
        assert plain.usage is not None and plain.usage.completion_tokens == 24
        assert plain.usage.prompt_tokens > 0
        assert plain.choices[0].finish_reason == "length"
        text, finish, usage = await _stream_text(client, model, max_tokens=24, temperature=0)
        assert text == plain.choices[0].text and finish == ["length"]
        assert usage.completion_tokens == 24 and usage.total_tokens == 24 + plain.usage.prompt_tokens

        # chat: streaming and not agree
        messages: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        reply = await client.chat.completions.create(model=model, messages=messages,
                                                     max_completion_tokens=12, temperature=0)
        assert reply.choices[0].message.role == "assistant"
        assert reply.usage is not None and reply.usage.completion_tokens == 12
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                                      temperature=0, stream=True)
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(pieces) == reply.choices[0].message.content

        # a stop string ends the text before it
        full = (await client.completions.create(model=model, prompt=PROMPT, max_tokens=40,
                                                temperature=0)).choices[0].text
        stop = next(full[i : i + 2] for i in range(3, len(full) - 2) if "\ufffd" not in full[i : i + 2])
        cut = await client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0,
                                              stop=[stop])
        assert cut.choices[0].text == full[: full.index(stop)]
        assert cut.choices[0].finish_reason == "stop"

        # concurrent greedy streams (spread over the instances) all give one stream's text
        reference = await _stream_text(client, model, max_tokens=100, temperature=0)  # greedy may stop at EOS
        results = await asyncio.wait_for(
            asyncio.gather(*(_stream_text(client, model, max_tokens=100, temperature=0) for _ in range(6))),
            180,
        )
        assert all(result == reference for result in results)
