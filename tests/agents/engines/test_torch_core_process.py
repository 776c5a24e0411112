"""The torch engine's model step in a process of its own (``core="process"``, ``shoal agent --engine-core``).

It must give the tokens the in-process engine gives, leave the caller's event
loop free while a step computes, fail loudly when its process dies, and never
outlive the process that started it or leave shared memory behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents.engines.protocol import EngineError, StepResult
from agents.engines.torch_engine import TorchEngine
from schemas import SamplingParams
from tests.agents.engines.loop_ticks import loop_ticks

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, top_p=0.95, seed=99)


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 41 + salt * 13 + 3) % 256 for i in range(n)]


def _add(engine: TorchEngine) -> None:
    engine.add_request("long", _prompt(70), GREEDY)  # three 24-token chunks of prefill
    engine.add_request("short", _prompt(9, 1), SEEDED)
    engine.add_request("drop", _prompt(12, 2), GREEDY)


def _shm_files(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"shoal-kv-{pid}-")]


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with open(f"/proc/{pid}/stat") as stat:  # a zombie has ended too
            if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        time.sleep(0.05)
    return False


async def test_steps_in_the_core_process_give_the_in_process_tokens_and_leave_the_loop_free() -> None:
    options: dict[str, object] = {"num_blocks": 32, "max_step_tokens": 24, "batch_invariant": True}
    engine = TorchEngine("tiny", core="process", **options)
    reference = TorchEngine("tiny", **options)
    assert engine.overlaps_loop and not reference.overlaps_loop
    assert engine.info == reference.info  # shape and identity come from the core process's model
    for e in (engine, reference):
        _add(e)
    outputs: dict[str, list[int]] = {}
    loop_ran: list[bool] = []
    async with loop_ticks() as ticks:
        while engine.has_unfinished():
            ticks.reset()
            step = asyncio.ensure_future(engine.step_async(exclusive=True))
            await asyncio.sleep(0)  # planned and handed over: the step now computes elsewhere
            if "drop" in outputs and engine.request_stats("drop") is not None:
                assert engine.abort("drop")  # mid-step: applied when the step completes
            result = await step
            loop_ran.append(ticks.count > 1)
            for out in result.outputs:
                outputs.setdefault(out.request_id, []).extend(out.token_ids)
    expected: dict[str, list[int]] = {}
    while reference.has_unfinished():
        for out in reference.step().outputs:
            expected.setdefault(out.request_id, []).extend(out.token_ids)
            if out.request_id == "drop":
                reference.abort("drop")
    assert outputs == expected
    assert len(outputs["long"]) == len(outputs["short"]) == 20 and len(outputs["drop"]) == 1
    assert all(loop_ran)  # even "exclusive" steps: other coroutines ran while each computed
    assert engine.stats().num_free_blocks == 32
    engine.close()


async def test_a_cancelled_step_does_not_confuse_the_next() -> None:
    engine = TorchEngine("tiny", num_blocks=16, core="process")
    reference = TorchEngine("tiny", num_blocks=16)
    engine.add_request("a", _prompt(30), GREEDY)
    reference.add_request("a", _prompt(30), GREEDY)
    step = asyncio.ensure_future(engine.step_async())
    await asyncio.sleep(0)
    step.cancel()  # its reply still comes and must be dropped, not taken for the next step's
    with pytest.raises(asyncio.CancelledError):
        await step
    tokens: list[list[int]] = []
    for e in (engine, reference):  # the cancelled plan was never applied: each runs from the prompt
        collected: list[int] = []
        tokens.append(collected)

        def collect(result: StepResult, into: list[int] = collected) -> None:
            into.extend(t for out in result.outputs for t in out.token_ids)

        await e.run_until_idle(collect)
    assert len(tokens[0]) == GREEDY.max_tokens
    assert tokens[0] == tokens[1]
    engine.close()


def test_a_dead_core_process_is_an_engine_error_and_close_ends_it() -> None:
    engine = TorchEngine("tiny", num_blocks=16, core="process")
    engine.add_request("a", _prompt(10), GREEDY)
    engine.step()
    assert engine._process is not None
    pid = engine._process.pid
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineError, match="exited"):
        engine.step()
    closing = TorchEngine("tiny", num_blocks=16, core="process")
    assert closing._process is not None
    pid = closing._process.pid
    closing.close()
    assert _gone(pid, 5.0)
    assert not _shm_files(os.getpid())


def test_bad_input_is_refused_before_or_by_the_core_process() -> None:
    with pytest.raises(ValueError, match="neither a preset"):
        TorchEngine("no-such-model", core="process")
    with pytest.raises(ValueError, match="CPU only"):
        TorchEngine("tiny", core="process", device="cuda")
    with pytest.raises(ValueError, match="core must be"):
        TorchEngine("tiny", core="gpu-thread")


def test_the_core_process_dies_with_its_parent_and_leaves_no_shared_memory(tmp_path: Path) -> None:
    script = (
        "import time\n"
        "from agents.engines.torch_engine import TorchEngine\n"
        "engine = TorchEngine('tiny', num_blocks=16, core='process')\n"
        "print(engine._process.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as parent:
        try:
            assert parent.stdout is not None
            child = int(parent.stdout.readline())
            assert not _gone(child, 0.2)
            parent.kill()  # SIGKILL: no cleanup runs in the parent
            parent.wait(10)
            assert _gone(child, 10.0)
            assert not _shm_files(parent.pid)
        finally:
            parent.kill()
