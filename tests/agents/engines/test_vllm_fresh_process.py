"""The vllm engine in a fresh interpreter, where process-wide state from other tests cannot hide a fault.

* bfloat16 (vLLM's default dtype) on a CPU with bfloat16 instructions. Linux grants AMX tiles
  per process, so an engine that never asks for them can only be caught in a process where
  nothing else asked first (a vLLM ``LLM`` or a long prefill in another test would). A short
  prompt first, as a client's ``"Hi"``: its attention runs before any AMX matrix multiply,
  where the process died of SIGILL when nobody had asked.
* An unpinned model thread (``--cpu-bind nobind``) in a process whose torch thread count was
  set below the CPU count (``torch.set_num_threads(1)``, as the torch engine's ``--threads``
  does): vLLM's CPU attention failed its check of the OpenMP team size.

Skipped, with the reason, without vLLM (and the first without bfloat16 instructions).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from agents.engines.vllm_engine import vllm_unavailable_reason
from agents.engines.vllm_engine.checkpoint import build_checkpoint

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)


def _bfloat16_unsupported_reason() -> str | None:
    reason = vllm_unavailable_reason()
    if reason is not None:
        return reason
    import torch

    capabilities = torch.cpu.get_capabilities()
    if not (capabilities.get("avx512_bf16") or capabilities.get("amx_bf16")):
        return "this CPU has neither AVX-512 BF16 nor AMX-BF16: vLLM's CPU build has no bfloat16 kernels here"
    return None


_REASON = _bfloat16_unsupported_reason()

#: a fresh process: the engine in bfloat16 on one pinned CPU (as shoal agent pins it), greedy
_SCRIPT = """
import json, os, sys
from agents.engines.vllm_engine.engine import VllmEngine
from schemas import SamplingParams

engine = VllmEngine(sys.argv[1], num_blocks=16, kv_cache_bytes=32 * 2**20, max_model_len=256,
                    cpus=(min(os.sched_getaffinity(0)),))
runs = []
for request_id, prompt in (("short", (5, 6)), ("again", (5, 6)), ("longer", tuple(range(3, 40)))):
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    tokens = []
    while engine.has_unfinished():
        for output in engine.step().outputs:
            tokens.extend(output.token_ids)
    runs.append(tokens)
stats = engine.stats()
print("RESULT " + json.dumps({"dtype": engine.info.model.dtype, "runs": runs, "free": stats.num_free_blocks,
                              "total": stats.num_total_blocks}), flush=True)
engine.shutdown()
"""


@pytest.mark.e2e
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_the_vllm_engine_serves_greedy_requests_in_bfloat16_from_a_short_first_prompt(tmp_path: Path) -> None:
    checkpoint = build_checkpoint(tmp_path / "llama")
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(checkpoint)],
        capture_output=True, text=True, timeout=600, check=False, cwd=Path(__file__).resolve().parents[3],
    )  # fmt: skip
    died = f" (killed by {signal.Signals(-result.returncode).name})" if result.returncode < 0 else ""
    assert result.returncode == 0, f"exit {result.returncode}{died}:\n{result.stderr[-3000:]}"
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    report = json.loads(line.removeprefix("RESULT "))
    assert report["dtype"] == "bfloat16"  # vLLM's default for this float32 checkpoint on CPU
    short, again, longer = report["runs"]
    assert len(short) == len(longer) == 8 and all(0 <= t < 512 for t in short + longer)
    assert short == again  # greedy: the same prompt gives the same tokens
    assert report["free"] == report["total"]  # every block back in the pool


_UNPINNED = """
import sys, torch
torch.set_num_threads(1)
from agents.engines.vllm_engine.engine import VllmEngine
from schemas import SamplingParams

engine = VllmEngine(sys.argv[1], num_blocks=16, kv_cache_bytes=32 * 2**20, max_model_len=256, dtype="float32")
engine.add_request("r", tuple(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
tokens = []
while engine.has_unfinished():
    for output in engine.step().outputs:
        tokens.extend(output.token_ids)
print("RESULT", len(tokens), flush=True)
engine.shutdown()
"""


@pytest.mark.e2e
@pytest.mark.skipif(vllm_unavailable_reason() is not None, reason=vllm_unavailable_reason() or "")
def test_an_unpinned_engine_serves_after_torch_threads_were_set_below_the_cpu_count(tmp_path: Path) -> None:
    checkpoint = build_checkpoint(tmp_path / "llama")
    result = subprocess.run(
        [sys.executable, "-c", _UNPINNED, str(checkpoint)],
        capture_output=True, text=True, timeout=600, check=False, cwd=Path(__file__).resolve().parents[3],
    )  # fmt: skip
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-3000:]}"
    assert "RESULT 4" in result.stdout


@pytest.mark.unit
def test_a_refused_amx_permission_says_which_dtype_to_use(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from agents.engines.vllm_engine.amx import AmxUnavailable, request_amx_tiles

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: False)
    with pytest.raises(AmxUnavailable, match="use --dtype float32"):
        request_amx_tiles("bfloat16")
    assert request_amx_tiles("float32") is False  # float32 does not use the tiles: it may run
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert request_amx_tiles("bfloat16") is False  # no AMX: nothing to ask for
