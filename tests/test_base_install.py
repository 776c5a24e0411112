"""The base install (``pip install shoal``, no extras) runs the control plane and the sim engine.

The end-to-end test runs ``shoal`` in interpreters that cannot import torch,
matplotlib, transformers or vllm (a ``sitecustomize`` on ``PYTHONPATH`` installs
an import hook refusing them, and every child process inherits it): ``shoal up
--engine sim`` serves a completion, ``shoal events`` lists the log and ``shoal
replay`` recomputes the request's dispatch, and what needs a missing extra (the
torch or vllm engine, a plot) exits with status 2 and names the extra, without
a traceback. The unit tests check how an import failure is traced to its extra.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from bus.extras import MissingExtra, missing_extra, require, require_engine
from bus.server import free_port
from tests.processes import alive

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("torch", "matplotlib", "transformers", "vllm")

SITECUSTOMIZE = f'''
import sys

BLOCKED = {BLOCKED!r}


class Refuse:
    """Import hook: the modules of shoal's extras are not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, Refuse())
'''


@pytest.fixture
def base_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a process whose Python has only the base install's packages."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(hook), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "COLUMNS": "200", "NO_COLOR": "1"}


def _shoal(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from frontend.cli import main; main()", *args],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _assert_names_extra(result: subprocess.CompletedProcess[str], module: str, extra: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert f"needs {module}, which is not installed" in output, output
    assert f"shoal[{extra}]" in output, output
    assert "Traceback" not in output, output


class _Lines:
    """A process's output lines, read on a thread so that every wait for one has a bound."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        assert process.stdout is not None
        self._stdout = stdout = process.stdout

        def pump() -> None:
            for line in stdout:
                self._queue.put(line.rstrip())
            self._queue.put(None)

        self._thread = threading.Thread(target=pump, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Once the process has ended: the rest of its output read, the pipe closed."""
        self._thread.join(timeout=10)
        self._stdout.close()

    def until(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError(f"no line starting {prefix!r} within {timeout} s:\n" + "\n".join(self.seen))


@pytest.mark.e2e
@pytest.mark.slow
def test_without_torch_or_matplotlib_shoal_up_sim_serves_and_extras_are_named(
    base_env: dict[str, str], tmp_path: Path
) -> None:
    for module in BLOCKED:  # the hook holds: these interpreters really lack the extras
        probe = subprocess.run([sys.executable, "-c", f"import {module}"], env=base_env,
                               capture_output=True, text=True, timeout=60)
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, (module, probe.stderr)

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", "from frontend.cli import main; main()", "up", "--engine", "sim",
         "--instances", "1", "--port", str(port), "--log-dir", str(tmp_path / "logs"),
         "--ready-timeout", "90"],
        env=base_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )
    lines = _Lines(process)
    try:
        nats_line = lines.until("nats-server", timeout=60)
        nats_url = nats_line.split()[1]
        lines.until("shoal is serving", timeout=120)
        pids = [int(found.group(1)) for line in lines.seen if (found := re.search(r"\bpid (\d+)", line))]
        assert len(pids) >= 4, lines.seen  # nats-server, scheduler, agent, frontend

        body = {"model": "sim:tiny-test", "prompt": "hello", "max_tokens": 4}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        request_id = reply.json()["id"]

        events = _shoal(base_env, "events", "list", "--nats", nats_url)
        assert events.returncode == 0 and "entries" in events.stdout, events.stdout + events.stderr
        replay = _shoal(base_env, "replay", "--nats", nats_url)
        assert replay.returncode == 0, replay.stdout + replay.stderr
        assert request_id in replay.stdout, replay.stdout  # its dispatch recomputed

        agent = _shoal(base_env, "agent", "--engine", "torch", "--nats", nats_url)
        _assert_names_extra(agent, "torch", "torch")
        vllm_agent = _shoal(base_env, "agent", "--engine", "vllm", "--nats", nats_url)
        _assert_names_extra(vllm_agent, "vllm", "vllm")
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        finally:
            process.kill()
            process.wait(10)
            lines.close()
    assert process.returncode == 0, lines.seen
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if alive(pid)], "a process outlived shoal up"

    up_torch = _shoal(base_env, "up", "--engine", "torch", "--instances", "1", "--port", str(free_port()),
                      "--log-dir", str(tmp_path / "logs-torch"))
    _assert_names_extra(up_torch, "torch", "torch")
    assert "pid" not in up_torch.stdout, up_torch.stdout  # refused before starting anything
    plots = _shoal(base_env, "simulate", "--requests", "40", "--plots", str(tmp_path / "plots"))
    _assert_names_extra(plots, "matplotlib", "bench")


@pytest.mark.unit
def test_a_missing_module_of_an_extra_is_traced_to_its_extra_through_causes_and_groups() -> None:
    deep = ModuleNotFoundError("No module named 'torch.nn'", name="torch.nn")
    wrapped = RuntimeError("the engine failed to start")
    wrapped.__cause__ = deep
    found = missing_extra(ExceptionGroup("agent", [ValueError("other"), wrapped]))
    assert found is not None and found.extra.name == "torch" and found.exit_code == 2
    assert "pip install 'shoal[torch]'" in found.format_message()
    plots = missing_extra(ModuleNotFoundError("No module named 'matplotlib'", name="matplotlib"))
    assert plots is not None and plots.extra.name == "bench"


@pytest.mark.unit
def test_other_import_failures_are_not_blamed_on_an_extra() -> None:
    assert missing_extra(ModuleNotFoundError("No module named 'nope'", name="nope")) is None
    handled = ValueError("unrelated")
    handled.__context__ = ModuleNotFoundError("No module named 'ucxx'", name="ucxx")  # tried, fell back
    assert missing_extra(handled) is None


@pytest.mark.unit
def test_an_engine_whose_module_is_missing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class Refuse:
        def find_spec(self, name: str, path: object = None, target: object = None) -> None:
            if name.partition(".")[0] == "vllm":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(sys, "meta_path", [Refuse(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    require_engine("sim")  # needs no extra
    with pytest.raises(MissingExtra) as refused:
        require_engine("vllm")
    assert refused.value.exit_code == 2
    assert refused.value.format_message().startswith("the vllm engine needs vllm, which is not installed")
    with pytest.raises(MissingExtra):
        require("vllm")
