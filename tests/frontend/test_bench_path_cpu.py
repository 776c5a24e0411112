"""The serving path's CPU per request: /proc parsing, the split by component and thread, the arithmetic."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import click
import pytest

from agents.engines.thread_name import name_os_thread
from frontend.bench_path_cpu import (
    PathMeter,
    ProcessInfo,
    Sampler,
    classify,
    cpu_table,
    gains,
    interpolate,
    load_window,
    parse_stat,
    path_ratios,
    per_request,
    read_cpu,
    varz_url,
)
from frontend.bench_vllm_serve import NotRunnable, Server, _int_list

TICK = os.sysconf("SC_CLK_TCK")
SHOAL = ("/venv/bin/python", "-c", "from frontend.cli import main; main()")


def stat_line(pid: int, comm: str, ppid: int, utime: int, stime: int) -> str:
    """A /proc stat line as the kernel writes it (52 fields)."""
    fields = ["S", str(ppid), *["0"] * 9, str(utime), str(stime), *["0"] * 37]
    return f"{pid} ({comm}) {' '.join(fields)}\n"


def test_a_stat_line_gives_the_name_parent_and_user_plus_system_ticks() -> None:
    parsed = parse_stat(stat_line(42, "python3", 7, 120, 30))
    assert (parsed.comm, parsed.ppid, parsed.ticks) == ("python3", 7, 150)
    # a thread may name itself with spaces and parentheses: the name ends at the last ')'
    odd = parse_stat(stat_line(43, "a) (b c)", 1, 5, 6))
    assert (odd.comm, odd.ticks) == ("a) (b c)", 11)
    with pytest.raises(ValueError):
        parse_stat("garbage")


def test_the_real_stat_of_this_process_parses() -> None:
    mine = parse_stat(Path(f"/proc/{os.getpid()}/stat").read_text())
    assert mine.ppid == os.getppid() and mine.ticks >= 0


def table(*rows: tuple[int, int, tuple[str, ...]]) -> dict[int, ProcessInfo]:
    return {pid: ProcessInfo(pid, ppid, argv) for pid, ppid, argv in rows}


def test_shoal_up_processes_are_named_by_their_command_lines() -> None:
    processes = table(
        (100, 1, (*SHOAL, "up", "--engine", "vllm")),
        (101, 100, ("/venv/bin/nats-server", "-a", "127.0.0.1", "-js")),
        (102, 100, (*SHOAL, "scheduler", "--nats-url", "x")),
        (103, 100, (*SHOAL, "agent", "--engine", "vllm")),
        (104, 103, ("/venv/bin/python", "-c", "from multiprocessing.spawn import spawn_main")),
        (105, 100, (*SHOAL, "serve", "--port", "8000")),
        (200, 1, (*SHOAL, "serve")),  # another shoal on the machine: not ours
    )
    groups = classify("shoal", 100, processes)
    assert groups == {
        "up": [100], "nats": [101], "scheduler": [102], "agent": [103], "model": [104], "frontend": [105],
    }  # fmt: skip


def test_vllm_serve_is_its_api_server_and_its_engine_core() -> None:
    processes = table(
        (300, 1, ("/venv/bin/python", "-m", "agents.engines.vllm_engine.vllm_cli", "serve", "/m")),
        (301, 300, ("/venv/bin/python", "-c", "from multiprocessing.resource_tracker import main;main(7)")),
        (302, 300, ("VLLM::EngineCore",)),
        (303, 302, ("VLLM::Worker",)),
    )
    groups = classify("vllm", 300, processes)
    assert groups == {"api_server": [300], "other": [301], "engine_core": [302], "model": [303]}


def fake_proc(root: Path, pid: int, comm: str, threads: dict[int, tuple[str, int]]) -> None:
    """``/proc/<pid>`` with its threads (name, ticks); the process's line sums them."""
    folder = root / str(pid)
    (folder / "task").mkdir(parents=True)
    total = sum(ticks for _, ticks in threads.values())
    (folder / "stat").write_text(stat_line(pid, comm, 1, total, 0))
    for tid, (name, ticks) in threads.items():
        (folder / "task" / str(tid)).mkdir()
        (folder / "task" / str(tid) / "stat").write_text(
            stat_line(tid, name, 1, ticks - ticks // 3, ticks // 3)
        )


def test_the_agent_is_split_into_its_model_thread_and_the_rest(tmp_path: Path) -> None:
    fake_proc(
        tmp_path, 10, "python", {10: ("python", 3 * TICK), 11: ("vllm-model", 8 * TICK), 12: ("python", TICK)}
    )
    fake_proc(tmp_path, 20, "python", {20: ("python", 2 * TICK)})
    fake_proc(tmp_path, 30, "nats-server", {30: ("nats-server", TICK), 31: ("nats-server", TICK)})
    cpu = read_cpu({"agent": [10], "frontend": [20], "nats": [30]}, proc=tmp_path)
    assert cpu == pytest.approx({"agent_loop": 4.0, "model": 8.0, "frontend": 2.0, "nats": 2.0})
    # an engine that steps on the loop's thread has no model thread: its agent is all loop, no model figure
    fake_proc(tmp_path, 40, "python", {40: ("python", 5 * TICK), 41: ("python", TICK)})
    assert read_cpu({"agent": [40]}, proc=tmp_path) == pytest.approx({"agent_loop": 6.0})


def test_a_named_thread_is_seen_by_its_name_in_proc() -> None:
    seen: list[str] = []

    def model_step() -> None:
        name_os_thread("vllm-model-and-more")  # cut to the kernel's 15 bytes
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    thread = threading.Thread(target=model_step)
    thread.start()
    thread.join()
    assert seen == ["vllm-model-and-"]
    assert Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip() != "vllm-model-and-"


def test_the_embedded_servers_monitoring_port_is_found_in_its_config(tmp_path: Path) -> None:
    config = tmp_path / "server.conf"
    config.write_text("server_name: a\nhttp: 127.0.0.1:8222\n")
    argv = ("/venv/bin/nats-server", "-a", "127.0.0.1", "-js", "-c", str(config))
    assert varz_url(argv) == "http://127.0.0.1:8222/varz"
    assert varz_url(("/venv/bin/nats-server", "-m", "9000")) == "http://127.0.0.1:9000/varz"
    config.write_text("server_name: a\n")
    assert varz_url(argv) is None


def test_the_load_is_cut_at_its_own_window_between_readings() -> None:
    # readings every second; the load ran from 1.5 s to 3.25 s
    series = [
        (0.0, {"frontend": 10.0, "bus_in_msgs": 100.0}),
        (1.0, {"frontend": 10.0, "bus_in_msgs": 100.0}),
        (2.0, {"frontend": 11.0, "bus_in_msgs": 300.0}),
        (3.0, {"frontend": 12.0, "bus_in_msgs": 500.0}),
        (4.0, {"frontend": 12.4, "bus_in_msgs": 520.0}),
    ]
    assert interpolate(series, 1.5) == pytest.approx({"frontend": 10.5, "bus_in_msgs": 200.0})
    assert interpolate(series, -1.0) == series[0][1] and interpolate(series, 9.0) == series[-1][1]
    gained = gains(interpolate(series, 1.5), interpolate(series, 3.25))
    assert gained == pytest.approx({"frontend": 1.6, "bus_in_msgs": 305.0})
    with pytest.raises(ValueError, match="restart"):
        gains({"agent_loop": 5.0}, {"agent_loop": 1.0})


def test_the_sampler_keeps_what_a_process_spent_within_the_window() -> None:
    meter = PathMeter("shoal", {"frontend": [os.getpid()]}, None)
    with Sampler(meter, period_s=0.02) as sampler:
        time.sleep(0.1)  # idle before the load: not counted
        start, spent_before = time.monotonic(), time.process_time()
        while time.process_time() - spent_before < 0.3:
            pass
        end = time.monotonic()
        time.sleep(0.1)
    assert len(sampler.cpu) > 5 and not sampler.bus
    assert 0.24 <= sampler.between(start, end)["frontend"] <= 0.45


def test_the_load_window_is_the_first_start_to_the_last_end_the_client_stamped() -> None:
    saved = {"start_times": [100.0, 100.5, 101.0], "latencies": [2.0, 3.0, 1.0]}
    assert load_window(saved) == (100.0, 103.5)
    with pytest.raises(ValueError, match="save-detailed"):
        load_window({"latencies": [1.0]})


def test_per_request_figures_and_the_path() -> None:
    delta = {"frontend": 0.4, "scheduler": 0.2, "agent_loop": 0.3, "nats": 0.1, "model": 9.0, "up": 0.01,
             "bus_in_msgs": 1200.0, "bus_out_msgs": 1600.0}  # fmt: skip
    figures = per_request(delta, requests=200, output_tokens=25600)
    assert figures["cpu_frontend_ms"] == pytest.approx(2.0)
    assert figures["cpu_path_ms"] == pytest.approx(5.0)  # frontend + scheduler + agent loop + nats
    assert figures["cpu_model_ms"] == pytest.approx(45.0)
    assert figures["bus_in_msgs_per_request"] == pytest.approx(6.0)
    assert figures["bus_out_msgs_per_token"] == pytest.approx(0.0625)
    vllm = per_request(
        {"api_server": 0.5, "engine_core": 8.0}, requests=200, output_tokens=25600, prefix="whole_"
    )
    assert vllm == pytest.approx(
        {"whole_cpu_api_server_ms": 2.5, "whole_cpu_engine_core_ms": 40.0, "whole_cpu_serve_path_ms": 42.5}
    )
    with pytest.raises(ValueError):
        per_request(delta, requests=0, output_tokens=0)
    # an agent whose engine steps on its loop's thread: no model figure, so no path either
    inline = per_request({k: v for k, v in delta.items() if k != "model"}, requests=200, output_tokens=25600)
    assert "cpu_path_ms" not in inline and inline["cpu_agent_loop_ms"] == pytest.approx(1.5)


def test_the_path_is_compared_with_the_api_server_round_by_round() -> None:
    shoal = [{"cpu_path_ms": 5.0}, {"cpu_path_ms": 3.0}, {}]
    vllm = [{"cpu_api_server_ms": 2.5}, {"cpu_api_server_ms": 3.0}, {"cpu_api_server_ms": 2.0}]
    assert path_ratios(shoal, vllm) == pytest.approx([2.0, 1.0])
    runs: dict[str, Any] = {
        "vllm": {8: [{"cpu_api_server_ms": 2.5, "cpu_engine_core_ms": 40.0}]},
        "shoal": {8: [{"cpu_path_ms": 5.0, "cpu_frontend_ms": 2.0, "bus_in_msgs_per_request": 6.0}]},
    }
    text = cpu_table(runs, ("vllm", "shoal"), (8,), "", "streamed")
    shoal_row = next(line for line in text.splitlines() if " shoal " in line).split()
    assert shoal_row[:3] == ["8", "shoal", "2.00"] and "5.00" in shoal_row and "2.00" in shoal_row[-5:]


def test_concurrencies_are_repeated_or_comma_separated() -> None:
    assert _int_list(("8,32",), "--concurrency") == (8, 32)
    assert _int_list(("8", "32"), "--concurrency") == (8, 32)
    for bad in (("0",), ("x",), ("",)):
        with pytest.raises(click.BadParameter):
            _int_list(bad, "--concurrency")


class _Ended:
    def __init__(self, code: int) -> None:
        self.returncode = code

    def poll(self) -> int:
        return self.returncode


def test_a_server_that_died_of_an_illegal_instruction_is_not_runnable(tmp_path: Path) -> None:
    log = tmp_path / "shoal-8000.log"
    log.write_text("starting\n")
    (tmp_path / "shoal-up").mkdir()
    (tmp_path / "shoal-up" / "agent-0.log").write_text(
        "loading\nagent-0 exited: SIGILL (illegal instruction)\n"
    )
    server = Server("shoal", _Ended(1), "http://127.0.0.1:8000", log)  # type: ignore[arg-type]
    with pytest.raises(NotRunnable, match="agent-0 exited: SIGILL"):
        server.raise_if_not_runnable()
    crashed = Server("vllm", _Ended(-4), "http://127.0.0.1:8001", tmp_path / "vllm-8001.log")  # type: ignore[arg-type]
    with pytest.raises(NotRunnable, match="SIGILL"):
        crashed.raise_if_not_runnable()
    vllm_log = tmp_path / "vllm-8002.log"
    vllm_log.write_text(
        "(EngineCore pid=9) ERROR Worker proc VllmWorker-0 died unexpectedly (exit code: -4), x\n"
    )
    with pytest.raises(NotRunnable, match="exit code: -4"):
        Server("vllm", _Ended(1), "http://127.0.0.1:8002", vllm_log).raise_if_not_runnable()  # type: ignore[arg-type]
    log.write_text("address already in use\n")
    (tmp_path / "shoal-up" / "agent-0.log").write_text("fine\n")
    server.raise_if_not_runnable()  # another failure: not this one
