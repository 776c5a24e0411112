"""``shoal drill --engine vllm``: the drills on agents that serve with vLLM, as an operator runs them.

The cluster's vllm agents get what ``shoal up --engine vllm`` gives them (a block size vLLM's CPU
attention takes, a small KV space, each its own share of the CPUs) and a checkpoint the drill builds
when none is named. The drill itself (kill -9 of the busiest of two vllm agents: its requests are
rescued on the other and every greedy answer equals the no-fault one) runs where vLLM is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from agents.engines.profile import TimingModel, load_profile
from agents.engines.vllm_engine import vllm_unavailable_reason
from frontend.drill.cli import drill
from frontend.drill.cluster import VLLM_DRILL_BLOCK_SIZE, VLLM_DRILL_KV_BYTES, DrillCluster
from frontend.drill.scenario import BUILTIN, ClusterSpec, ScenarioError

_SHOAL = [sys.executable, "-c", "from frontend.cli import main; main()"]
_REASON = vllm_unavailable_reason()
#: the vLLM drill: its agents may take 300 s to start (VLLM_READY_TIMEOUT_S), the drill about 45 s
_DRILL_TIMEOUT_S = 420


def _value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_vllm_agents_get_the_engine_options_shoal_up_gives_them(tmp_path: Path) -> None:
    cluster = DrillCluster(ClusterSpec(engine="vllm", model="/ckpt", instances=2), tmp_path)
    cluster.cpu_binds = ["0", "1"]  # as split on a 2-CPU machine (vLLM's CPU build)
    cluster.agent_ids = ["agent-0", "agent-1"]
    first = cluster.agent_args("agent-0", 7000, "nats://127.0.0.1:4222")
    second = cluster.agent_args("agent-1", 7001, "nats://127.0.0.1:4222")
    assert _value(first, "--engine") == "vllm" and _value(first, "--model") == "/ckpt"
    assert _value(first, "--block-size") == str(VLLM_DRILL_BLOCK_SIZE)
    assert _value(first, "--kv-cache-bytes") == str(VLLM_DRILL_KV_BYTES)
    assert "--num-blocks" not in first
    assert _value(first, "--dtype") == "float32"  # greedy answers comparable exactly (not vLLM's bfloat16)
    assert (_value(first, "--cpu-bind"), _value(second, "--cpu-bind")) == ("0", "1")
    assert cluster.ready_timeout_s >= 300 and cluster.agent_start_timeout_s >= 300
    # a scenario that sizes the KV in blocks gets exactly that, not a second budget
    sized = DrillCluster(ClusterSpec(engine="vllm", model="/ckpt", num_blocks=64), tmp_path)
    args = sized.agent_args("agent-0", 7000, "nats://127.0.0.1:4222")
    assert _value(args, "--num-blocks") == "64" and "--kv-cache-bytes" not in args
    # the other engines are as before
    torch_args = DrillCluster(ClusterSpec(engine="torch"), tmp_path).agent_args("agent-0", 7000, "nats://x:1")
    assert "--cpu-bind" not in torch_args and "--block-size" not in torch_args
    assert "--dtype" not in torch_args  # the torch engine's own default (float32 on CPU)
    half = DrillCluster(ClusterSpec(engine="vllm", model="/ckpt", dtype="bfloat16"), tmp_path)
    assert _value(half.agent_args("agent-0", 7000, "nats://x:1"), "--dtype") == "bfloat16"


def test_a_vllm_cluster_without_a_checkpoint_is_a_clear_error() -> None:
    with pytest.raises(ScenarioError, match="vllm drill needs a checkpoint"):
        _ = ClusterSpec(engine="vllm").resolved_model


def test_without_vllm_the_drill_says_so_and_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import agents.engines.vllm_engine as vllm_engine

    monkeypatch.setattr(
        vllm_engine, "vllm_unavailable_reason", lambda: "vLLM is not installed (run ./install.sh --vllm)"
    )
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = CliRunner().invoke(drill, ["baseline", "--engine", "vllm"])
    assert result.exit_code == 2
    assert "vLLM is not installed" in result.output
    assert not list(tmp_path.iterdir())  # the drill's folder is removed, nothing was started


def test_a_malformed_cpu_bind_list_is_a_usage_error_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import agents.engines.vllm_engine as vllm_engine

    monkeypatch.setattr(vllm_engine, "vllm_unavailable_reason", lambda: None)
    monkeypatch.setattr(vllm_engine, "vllm_version", lambda: "0.32.0+cpu")  # vLLM's CPU build splits CPUs
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1,zz")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = CliRunner().invoke(drill, ["torch-agent-kill", "--engine", "vllm"])
    assert result.exit_code == 2, result.output
    assert "VLLM_CPU_OMP_THREADS_BIND" in result.output and "'zz'" in result.output
    assert not list(tmp_path.iterdir())  # no checkpoint built, no cluster started


@pytest.mark.drill
@pytest.mark.slow
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
@pytest.mark.timeout(_DRILL_TIMEOUT_S + 60)  # vLLM agents may take 300 s to start: past the default 300 s
def test_killing_a_busy_vllm_agent_loses_nothing_and_greedy_answers_stay_exact(tmp_path: Path) -> None:
    report = tmp_path / "drill.json"
    try:
        done = subprocess.run(
            [*_SHOAL, "drill", "torch-agent-kill", "--engine", "vllm", "--json", str(report)],
            capture_output=True,
            text=True,
            timeout=_DRILL_TIMEOUT_S,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the vLLM drill did not end within {_DRILL_TIMEOUT_S} s: {str(exc.stderr)[-3000:]}")
    assert report.exists(), done.stdout + done.stderr[-3000:]
    (scenario,) = json.loads(report.read_text())["scenarios"]
    failed = [v for v in scenario["verdicts"] if v["status"] != "passed"]  # greedy text must be checked
    assert scenario["passed"] and not failed, json.dumps(failed or scenario["error"]) + done.stderr[-3000:]
    assert done.returncode == 0
    assert scenario["scenario"]["cluster"]["engine"] == "vllm"
    requests = scenario["requests"]
    assert requests["lost"] == 0 and requests["mismatch"] == 0 and requests["ok"] > 0
    assert scenario["greedy"]["compared"] > 0  # greedy answers were compared with the no-fault ones
    assert scenario["rescues"] >= 1  # the killed agent's requests went on elsewhere
    assert all(f["verified"] for f in scenario["faults"])
    assert all(a["num_used_blocks"] == 0 and a["num_reserved_blocks"] == 0 for a in scenario["agents"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("shoal-")]  # checkpoint and stores removed


def test_a_sim_scenario_on_a_real_engine_keeps_its_pace() -> None:
    sim = BUILTIN["agent-kill-busy"].cluster  # written for the sim's pace: requests last seconds
    on_vllm = sim.on_engine("vllm")
    assert on_vllm.engine == "vllm" and on_vllm.model is None
    # each step lasts at least the sim's one-request decode step at the scenario's time scale
    decode_s = TimingModel(load_profile(sim.resolved_model)).decode_ms(1, 0) / 1000
    assert on_vllm.min_step_s == pytest.approx(decode_s * sim.time_scale, rel=1e-3) and on_vllm.min_step_s > 0
    assert sim.on_engine("torch").min_step_s == on_vllm.min_step_s
    paced = BUILTIN["torch-agent-kill"].cluster  # a real-engine scenario keeps its own pace
    assert paced.on_engine("vllm").min_step_s == paced.min_step_s
    assert sim.on_engine("sim") is sim
