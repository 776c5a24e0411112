"""Which CPUs the in-process vLLM worker's model thread gets, as vLLM's own CPU worker would (no vLLM needed).

vLLM binds its CPU worker's OpenMP threads only in its multiprocess executor:
``auto`` keeps the last CPU for everything else, ``nobind`` binds nothing, a
list is used as given. ``shoal agent --engine vllm`` does the same for the
worker it runs in-process (``--cpu-bind`` wins over the variable), and
``shoal up`` gives each agent its own share.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from agents.cli import agent
from agents.engines.vllm_engine.cpu_binding import (
    CpuBinding,
    format_cpu_list,
    one_per_core,
    parse_cpu_list,
    physical_cores,
    plan_cpu_binding,
    split_for_instances,
)


def test_cpu_lists_parse_and_format_both_ways() -> None:
    assert parse_cpu_list("0-3,5") == (0, 1, 2, 3, 5)
    assert parse_cpu_list(" 7, 2-3,3") == (2, 3, 7)
    assert format_cpu_list((0, 1, 2, 3, 5, 9, 10)) == "0-3,5,9-10"
    assert parse_cpu_list(format_cpu_list((4, 6, 7, 8))) == (4, 6, 7, 8)
    for bad in ("", "a", "3-1", "-1", "0-"):
        with pytest.raises(ValueError, match="not a CPU id or a range"):
            parse_cpu_list(bad)


def test_auto_keeps_the_last_cpu_for_the_agent_and_gives_the_model_the_rest() -> None:
    binding = plan_cpu_binding([3, 0, 1, 2], {})
    assert binding == CpuBinding((0, 1, 2), (3,), "auto, as vLLM's CPU worker")
    assert binding.num_threads == 3
    assert binding.describe() == (
        "vllm model thread bound to CPU 0-2 with 3 OpenMP thread(s), CPU 3 left to the rest "
        "(auto, as vLLM's CPU worker)"
    )
    assert plan_cpu_binding([0, 1], {"VLLM_CPU_OMP_THREADS_BIND": "auto"}).cpus == (0,)
    assert plan_cpu_binding([5], {}).cpus == (5,)  # one CPU: nothing to keep back
    # vLLM's reserved count is honoured; when it leaves nothing, the model gets them all (vLLM: a warning)
    assert plan_cpu_binding(range(8), {"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"}).cpus == tuple(range(6))
    assert plan_cpu_binding(range(2), {"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"}).cpus == (0, 1)
    assert plan_cpu_binding(range(2), {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}).cpus == (0, 1)
    with pytest.raises(ValueError, match="VLLM_CPU_NUM_OF_RESERVED_CPU='x'"):
        plan_cpu_binding(range(2), {"VLLM_CPU_NUM_OF_RESERVED_CPU": "x"})


def test_nobind_and_explicit_lists_from_the_variable_or_the_option() -> None:
    nobind = plan_cpu_binding(range(4), {"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    assert nobind.cpus == () and nobind.num_threads is None
    assert nobind.describe() == "vllm model thread not bound to CPUs (VLLM_CPU_OMP_THREADS_BIND=nobind)"
    listed = plan_cpu_binding(range(4), {"VLLM_CPU_OMP_THREADS_BIND": "1-2"})
    assert (listed.cpus, listed.reserved) == ((1, 2), (0, 3))
    # --cpu-bind wins over the variable, both ways
    assert plan_cpu_binding(range(4), {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, "3").cpus == (3,)
    assert plan_cpu_binding(range(4), {"VLLM_CPU_OMP_THREADS_BIND": "1-2"}, "nobind").cpus == ()
    assert plan_cpu_binding(range(4), {"VLLM_CPU_OMP_THREADS_BIND": "1-2"}, "auto").cpus == (0, 1, 2)
    with pytest.raises(
        ValueError, match=r"--cpu-bind 2-5: CPU 4-5 not allowed to this process \(allowed: 0-3"
    ):
        plan_cpu_binding(range(4), {}, "2-5")
    with pytest.raises(ValueError, match="one CPU list per agent"):
        plan_cpu_binding(range(4), {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"})


def test_shoal_up_gives_each_agent_its_own_cpus_when_there_are_enough() -> None:
    assert split_for_instances(range(2), 1, {}) == ["0"]  # CPU 1: frontend, scheduler, the agent's loop
    assert split_for_instances(range(8), 2, {}) == ["0-3", "4-6"]  # CPU 7 kept back
    assert split_for_instances(range(4), 3, {}) == ["0", "1", "2"]
    assert split_for_instances(range(8), 3, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"}) == ["0-1", "2-3", "4-5"]
    # too few CPUs: one each, shared round robin (nothing is kept back)
    assert split_for_instances(range(2), 2, {}) == ["0", "1"]
    assert split_for_instances([4, 6], 3, {}) == ["4", "6", "4"]
    # the variable: nobind for all, or one '|'-separated list per agent
    assert split_for_instances(range(4), 2, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) == ["nobind", "nobind"]
    assert split_for_instances(range(4), 3, {"VLLM_CPU_OMP_THREADS_BIND": "0|1-2"}) == ["0", "1-2", "0"]
    with pytest.raises(ValueError, match="not a CPU id"):
        split_for_instances(range(4), 2, {"VLLM_CPU_OMP_THREADS_BIND": "0|x"})
    assert split_for_instances(range(4), 0, {}) == []


def test_shoal_agent_refuses_cpus_it_may_not_use_before_starting_anything(tmp_path: Path) -> None:
    result = CliRunner().invoke(agent, ["--engine", "vllm", "--model", str(tmp_path), "--cpu-bind", "100000"])
    assert result.exit_code == 2, result.output
    assert "--cpu-bind 100000: CPU 100000 not allowed to this process" in result.output
    assert "Traceback" not in result.output


def test_auto_takes_one_logical_cpu_per_physical_core_as_vllm_on_x86(tmp_path: Path) -> None:
    # 4 logical CPUs, 2 cores with 2 SMT siblings each (0/2 and 1/3), as Linux's sysfs describes them
    for cpu, core in ((0, 0), (1, 1), (2, 0), (3, 1)):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    cores = physical_cores([0, 1, 2, 3, 9], str(tmp_path))
    assert cores == {0: ("0", "0"), 1: ("0", "1"), 2: ("0", "0"), 3: ("0", "1")}  # CPU 9: not described
    assert one_per_core([0, 1, 2, 3], cores) == (2, 3)  # the last sibling of each core, as vLLM
    assert one_per_core([0, 1, 2, 3], None) == (0, 1, 2, 3)
    binding = plan_cpu_binding([0, 1, 2, 3], {}, None, cores)
    assert (binding.cpus, binding.reserved) == ((2,), (3,))
    assert split_for_instances([0, 1, 2, 3], 1, {}, cores) == ["2"]
    assert split_for_instances([0, 1, 2, 3], 2, {}, cores) == ["2", "3"]
    # an explicit list is taken as given, siblings included
    assert plan_cpu_binding([0, 1, 2, 3], {}, "0,2", cores).cpus == (0, 2)


def test_the_agent_command_leaves_the_temporary_folder_as_it_found_it(tmp_path: Path) -> None:
    # a vllm agent runs in a temporary folder of its own; in-process (a CliRunner, a test), the
    # caller's is back afterwards, and the agent's is gone
    import os
    import tempfile

    before = os.environ.get("TMPDIR"), tempfile.gettempdir()
    CliRunner().invoke(agent, ["--engine", "vllm", "--model", str(tmp_path), "--cpu-bind", "100000"])
    assert (os.environ.get("TMPDIR"), tempfile.gettempdir()) == before
    assert os.path.isdir(tempfile.gettempdir())
