"""The serving path's CPU per request, per component, from /proc: what ``shoal bench vllm-serve`` and
``shoal bench path-cpu`` report.

A server under test is a tree of processes under the one the benchmark
started. :func:`classify` names each process of the tree by its command line:

* ``shoal up``: ``nats`` (the embedded ``nats-server``), ``frontend``
  (``shoal serve``), ``scheduler``, ``agent`` (an engine core process under an
  agent counts as ``model``) and ``up`` (the supervisor itself);
* ``vllm serve``: ``api_server`` (the process started), ``engine_core`` (its
  engine core child: scheduling, inputs and outputs) and ``model`` (the engine
  core's worker process, ``VLLM::Worker``: the model's step); ``serve_path`` is
  API server + engine core.

The agent's CPU is split by thread (``/proc/<pid>/task/<tid>/stat``): threads
whose name starts with a model-thread prefix (:data:`MODEL_THREAD_PREFIXES`:
the vLLM engine names its model thread ``vllm-model``) are ``model``, the rest
of the process is ``agent_loop``. shoal's ``path`` is frontend + scheduler +
agent_loop + nats: all it spends per request besides the model's step.

The readings (cumulative CPU seconds, and the nats-server's message counters
from its ``/varz``) are taken every quarter second while a client runs
(:class:`Sampler`) and cut at the load's own window: from the first request's
start to the last one's end, as the client stamped them (``vllm bench serve
--save-detailed``), so neither the client's start-up nor the idle time around
the load counts. A process that dies during a run shows as a counter going
back: :func:`gains` refuses it.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import statistics
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MODEL_THREAD_PREFIXES",
    "PATH_COMPONENTS",
    "PathMeter",
    "ProcessInfo",
    "Sampler",
    "TaskCpu",
    "classify",
    "cpu_table",
    "descendants",
    "drive_whole",
    "gains",
    "interpolate",
    "load_window",
    "parse_stat",
    "path_ratios",
    "per_request",
    "process_table",
    "prompt_vocabulary",
    "read_cpu",
    "read_varz",
    "varz_url",
]

#: thread names (``comm``, as the kernel keeps them) of an engine's model step in the agent
MODEL_THREAD_PREFIXES = ("vllm-model",)
#: shoal's serving path: every component but the model's step (and ``up``, the idle supervisor)
PATH_COMPONENTS = ("frontend", "scheduler", "agent_loop", "nats")
_SHOAL_SUBCOMMANDS = {"serve": "frontend", "scheduler": "scheduler", "agent": "agent"}
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


@dataclass(frozen=True)
class TaskCpu:
    """One ``/proc/.../stat`` line: the name, the parent process and user + system CPU in clock ticks."""

    comm: str
    ppid: int
    ticks: int


def parse_stat(text: str) -> TaskCpu:
    """Parse a ``/proc/<pid>/stat`` or ``/proc/<pid>/task/<tid>/stat`` line (the name may hold spaces
    and parentheses: it ends at the last ``)``)."""
    head, _, rest = text.rpartition(")")
    if not head or "(" not in head:
        raise ValueError(f"not a /proc stat line: {text[:80]!r}")
    comm = head.split("(", 1)[1]
    fields = rest.split()  # fields[0] is field 3 (state): field n is fields[n - 3]
    return TaskCpu(comm=comm, ppid=int(fields[1]), ticks=int(fields[11]) + int(fields[12]))


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    argv: tuple[str, ...]


def process_table(proc: Path = Path("/proc")) -> dict[int, ProcessInfo]:
    """Every live process: its parent and command line."""
    table: dict[int, ProcessInfo] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = parse_stat((entry / "stat").read_text())
            argv = tuple(
                arg for arg in (entry / "cmdline").read_bytes().decode(errors="replace").split("\0") if arg
            )
        except (OSError, ValueError):
            continue
        table[int(entry.name)] = ProcessInfo(int(entry.name), stat.ppid, argv)
    return table


def descendants(root: int, table: Mapping[int, ProcessInfo]) -> list[int]:
    """The processes below ``root`` (children first, then theirs), without ``root``."""
    children: dict[int, list[int]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info.pid)
    found: list[int] = []
    frontier = [root]
    while frontier:
        below = sorted(pid for parent in frontier for pid in children.get(parent, []))
        found.extend(below)
        frontier = below
    return found


def _shoal_role(argv: tuple[str, ...]) -> str | None:
    if argv and Path(argv[0]).name == "nats-server":
        return "nats"
    # shoal's children: python -c "from frontend.cli import main; main()" SUBCOMMAND ...
    for index, arg in enumerate(argv[:-1]):
        if "frontend.cli" in arg:
            return _SHOAL_SUBCOMMANDS.get(argv[index + 1])
    return None


def classify(kind: str, root: int, table: Mapping[int, ProcessInfo]) -> dict[str, list[int]]:
    """The processes of the server started as ``root``, by component (see the module's text).

    ``kind``: ``vllm`` (``vllm serve``) or a shoal server (``shoal up``). A process no rule names
    takes its parent's component (an agent's children are its ``model``).
    """
    roles: dict[int, str] = {root: "api_server" if kind == "vllm" else "up"}
    for pid in descendants(root, table):
        argv = table[pid].argv
        parent = roles.get(table[pid].ppid, "other")
        if kind == "vllm":  # API server -> engine core (VLLM::EngineCore) -> its worker (VLLM::Worker)
            if any("resource_tracker" in arg for arg in argv):
                role = "other"
            else:
                role = "engine_core" if parent == "api_server" else "model"
        else:
            role = _shoal_role(argv) or ("model" if parent == "agent" else parent)
        roles[pid] = role
    groups: dict[str, list[int]] = {}
    for pid, role in roles.items():
        groups.setdefault(role, []).append(pid)
    return groups


def _process_seconds(pid: int, proc: Path) -> float:
    return parse_stat((proc / str(pid) / "stat").read_text()).ticks * _TICK_S


def _thread_seconds(pid: int, prefixes: Iterable[str], proc: Path) -> float | None:
    """CPU seconds of ``pid``'s live threads whose name starts with one of ``prefixes``; None if
    it has none (an engine that steps on the event loop's thread)."""
    total, found = 0, False
    for task in (proc / str(pid) / "task").iterdir():
        try:
            stat = parse_stat((task / "stat").read_text())
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        if stat.comm.startswith(tuple(prefixes)):
            total, found = total + stat.ticks, True
    return total * _TICK_S if found else None


def read_cpu(groups: Mapping[str, list[int]], proc: Path = Path("/proc")) -> dict[str, float]:
    """Cumulative CPU seconds by component; ``agent`` split into ``model`` (its model threads, and
    any process under it; left out where it has no model thread) and ``agent_loop`` (the rest of
    the agent process).

    An ``OSError`` (a process gone) propagates: a reading without it would be wrong.
    """
    cpu: dict[str, float] = {}
    for role, pids in groups.items():
        if role == "agent":
            for pid in pids:
                whole = _process_seconds(pid, proc)
                model = _thread_seconds(pid, MODEL_THREAD_PREFIXES, proc)
                cpu["agent_loop"] = cpu.get("agent_loop", 0.0) + whole - (model or 0.0)
                if model is not None:
                    cpu["model"] = cpu.get("model", 0.0) + model
        else:
            cpu[role] = cpu.get(role, 0.0) + sum(_process_seconds(pid, proc) for pid in pids)
    return cpu


_HTTP_LINE = re.compile(r"^\s*http\s*:\s*\"?([\w.\-]+):(\d+)", re.MULTILINE)


def varz_url(nats_argv: tuple[str, ...]) -> str | None:
    """The ``/varz`` URL of a nats-server started with ``-c FILE`` whose file has an ``http`` line
    (``shoal up``'s embedded server), or with ``-m PORT``; None without monitoring."""
    for flag, value in itertools.pairwise(nats_argv):
        if flag in ("-m", "--http_port"):
            return f"http://127.0.0.1:{value}/varz"
        if flag in ("-c", "--config"):
            try:
                match = _HTTP_LINE.search(Path(value).read_text())
            except OSError:
                return None
            if match:
                return f"http://{match.group(1)}:{match.group(2)}/varz"
    return None


def read_varz(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """The nats-server's cumulative message counters: ``bus_in_msgs`` (published to it, JetStream's
    own included) and ``bus_out_msgs`` (delivered by it)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        data = json.loads(response.read())
    return {"bus_in_msgs": float(data["in_msgs"]), "bus_out_msgs": float(data["out_msgs"])}


def gains(first: Mapping[str, float], last: Mapping[str, float]) -> dict[str, float]:
    """What each counter gained from ``first`` to ``last``; ValueError on one that went back (its
    process restarted or died meanwhile: the figure would be wrong)."""
    gained: dict[str, float] = {}
    for key, end in last.items():
        if key in first:
            if end - first[key] < -1e-9:
                raise ValueError(f"{key} went back from {first[key]:.3f} to {end:.3f}: did it restart?")
            gained[key] = max(0.0, end - first[key])
    return gained


def per_request(
    delta: Mapping[str, float], requests: int, output_tokens: int, prefix: str = ""
) -> dict[str, float]:
    """The figures reported for one client run: ``cpu_<component>_ms`` per request, ``cpu_path_ms``
    (shoal's path, when the run has its components and the model's step was set apart from the
    agent's loop), ``bus_*_per_request`` and ``bus_*_per_token``;
    every key starts with ``prefix`` (``whole_`` for non-streamed runs)."""
    if requests <= 0 or output_tokens <= 0:
        raise ValueError(f"{requests} requests and {output_tokens} output tokens: nothing to divide by")
    figures: dict[str, float] = {}
    for key, value in delta.items():
        if key.startswith("bus_"):
            figures[f"{prefix}{key}_per_request"] = value / requests
            figures[f"{prefix}{key}_per_token"] = value / output_tokens
        else:
            figures[f"{prefix}cpu_{key}_ms"] = 1000.0 * value / requests
    if all(component in delta for component in (*PATH_COMPONENTS, "model")):  # the step set apart
        figures[f"{prefix}cpu_path_ms"] = 1000.0 * sum(delta[c] for c in PATH_COMPONENTS) / requests
    if "api_server" in delta and "engine_core" in delta:
        figures[f"{prefix}cpu_serve_path_ms"] = (
            1000.0 * (delta["api_server"] + delta["engine_core"]) / requests
        )
    return figures


@dataclass
class PathMeter:
    """The readings of one running server: its components' CPU and, where it has one, its nats-server's
    message counters."""

    kind: str
    groups: dict[str, list[int]]
    varz: str | None

    @classmethod
    def attach(cls, kind: str, root: int) -> PathMeter:
        table = process_table()
        groups = classify(kind, root, table)
        nats = groups.get("nats", [])
        return cls(kind, groups, varz_url(table[nats[0]].argv) if nats else None)

    def read(self) -> dict[str, float]:
        reading = read_cpu(self.groups)
        if self.varz is not None:
            reading.update(read_varz(self.varz))
        return reading


class Sampler:
    """Readings of a :class:`PathMeter` every ``period_s`` on a thread of this process (the nats-server's
    ``/varz`` every ``varz_every``-th, sparing it the polling), each with its ``time.monotonic()``: the
    clock ``vllm bench serve`` stamps its requests with (``perf_counter``, CLOCK_MONOTONIC on Linux)."""

    def __init__(self, meter: PathMeter, period_s: float = 0.25, varz_every: int = 4) -> None:
        import threading

        self.meter, self.period_s, self.varz_every = meter, period_s, varz_every
        self.cpu: list[tuple[float, dict[str, float]]] = []
        self.bus: list[tuple[float, dict[str, float]]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="path-cpu-sampler", daemon=True)

    def _sample(self, index: int) -> None:
        import time

        self.cpu.append((time.monotonic(), read_cpu(self.meter.groups)))
        if self.meter.varz is not None and index % self.varz_every == 0:
            self.bus.append((time.monotonic(), read_varz(self.meter.varz)))

    def _run(self) -> None:
        index = 1
        try:
            while not self._stop.wait(self.period_s):
                self._sample(index)
                index += 1
        except BaseException as error:  # reported by stop()
            self.error = error

    def __enter__(self) -> Sampler:
        self._sample(0)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30.0)
        if self.error is None:
            self._sample(0)

    def between(self, start: float, end: float) -> dict[str, float]:
        """What each counter gained from ``start`` to ``end`` (interpolated between readings)."""
        if self.error is not None:
            raise RuntimeError(f"reading the server's counters failed: {self.error!r}")
        gained: dict[str, float] = {}
        for series in (self.cpu, self.bus):
            if series:
                gained.update(gains(interpolate(series, start), interpolate(series, end)))
        return gained


def interpolate(series: Sequence[tuple[float, Mapping[str, float]]], when: float) -> dict[str, float]:
    """The counters at ``when``, linear between the readings around it (the first or last reading
    outside them)."""
    if not series:
        raise ValueError("no readings")
    if when <= series[0][0]:
        return dict(series[0][1])
    for (t0, r0), (t1, r1) in itertools.pairwise(series):
        if t0 <= when <= t1:
            share = (when - t0) / (t1 - t0) if t1 > t0 else 1.0
            return {key: r0[key] + share * (r1[key] - r0[key]) for key in r1 if key in r0}
    return dict(series[-1][1])


def load_window(result: Mapping[str, object]) -> tuple[float, float]:
    """The first request's start and the last one's end, on CLOCK_MONOTONIC, from ``vllm bench serve
    --save-detailed``'s ``start_times`` and ``latencies``."""
    starts, latencies = result.get("start_times"), result.get("latencies")
    if not isinstance(starts, list) or not isinstance(latencies, list) or not starts:
        raise ValueError("the result has no start_times and latencies (vllm bench serve --save-detailed)")
    ends = [float(s) + float(lat) for s, lat in zip(starts, latencies, strict=True) if lat]
    return min(float(s) for s in starts), max(ends, default=max(float(s) for s in starts))


async def drive_whole(
    url: str, model: str, *, concurrency: int, num_prompts: int, input_len: int, output_len: int,
    vocab: Sequence[int], seed: int, ignore_eos: bool = True,
) -> dict[str, float]:  # fmt: skip
    """``num_prompts`` non-streamed ``/v1/completions`` of ``input_len`` token ids each (drawn from
    ``vocab``), ``concurrency`` at a time (aiohttp): completed requests, output tokens (from
    ``usage``), seconds, and the load's window on ``time.monotonic()``."""
    import asyncio
    import random
    import time

    import aiohttp

    chooser = random.Random(seed)
    prompts = [[chooser.choice(vocab) for _ in range(input_len)] for _ in range(num_prompts)]
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    done = {"completed": 0, "output_tokens": 0}

    async def worker(client: aiohttp.ClientSession) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                    "ignore_eos": ignore_eos, "stream": False}  # fmt: skip
            async with client.post(f"{url}/v1/completions", json=body) as response:
                response.raise_for_status()
                answer = await response.json()
            done["completed"] += 1
            done["output_tokens"] += int(answer["usage"]["completion_tokens"])

    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=3600)
    ) as client:
        started = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        ended = time.monotonic()
    seconds = ended - started
    return {"completed": float(done["completed"]), "output_tokens": float(done["output_tokens"]),
            "duration_s": seconds, "output_tps": done["output_tokens"] / seconds,
            "started": started, "ended": ended}  # fmt: skip


#: the CPU table's columns: (heading, the figure's key without its prefix)
_CPU_COLUMNS = (
    ("frontend", "cpu_frontend_ms"),
    ("scheduler", "cpu_scheduler_ms"),
    ("agent loop", "cpu_agent_loop_ms"),
    ("nats", "cpu_nats_ms"),
    ("PATH", "cpu_path_ms"),
    ("model", "cpu_model_ms"),
    ("API server", "cpu_api_server_ms"),
    ("engine core", "cpu_engine_core_ms"),
    ("API+core", "cpu_serve_path_ms"),
)
_BUS_COLUMNS = (
    ("bus in/req", "bus_in_msgs_per_request"),
    ("out/req", "bus_out_msgs_per_request"),
    ("in/tok", "bus_in_msgs_per_token"),
    ("out/tok", "bus_out_msgs_per_token"),
)


def path_ratios(
    server: Sequence[Mapping[str, float]], vllm: Sequence[Mapping[str, float]], prefix: str = ""
) -> list[float]:
    """Each round's shoal path CPU per request over ``vllm serve``'s API server's in the same round
    (rounds without both figures left out)."""
    path, api = f"{prefix}cpu_path_ms", f"{prefix}cpu_api_server_ms"
    return [s[path] / v[api] for s, v in zip(server, vllm, strict=False) if path in s and v.get(api)]


def cpu_table(
    runs: Mapping[str, Mapping[int, Sequence[Mapping[str, float]]]],
    kinds: Sequence[str],
    levels: Sequence[int],
    prefix: str,
    title: str,
) -> str:
    """The CPU per request (ms, median over rounds) of each component of each server, shoal's path
    over vllm serve's API server (the median of the paired rounds' ratios), and the bus messages."""
    head = f"{'conc':>5} {'server':>16} " + " ".join(f"{name:>11}" for name, _ in _CPU_COLUMNS)
    head += f" {'PATH/API':>9} " + " ".join(f"{name:>10}" for name, _ in _BUS_COLUMNS)
    lines = [f"\nCPU ms per request, {title}; medians of rounds (-: not separable or not there)", head]
    for concurrency in levels:
        vllm_runs = runs.get("vllm", {}).get(concurrency, [])
        for kind in kinds:
            rounds = runs[kind].get(concurrency, [])
            if not rounds:
                continue
            cells = []
            for _, key in (*_CPU_COLUMNS, *_BUS_COLUMNS):
                values = [run[prefix + key] for run in rounds if prefix + key in run]
                cells.append(f"{statistics.median(values):.2f}" if len(values) == len(rounds) else "-")
            ratios = path_ratios(rounds, vllm_runs, prefix) if kind != "vllm" else []
            ratio = f"{statistics.median(ratios):.2f}" if ratios else "-"
            cpu = " ".join(f"{cell:>11}" for cell in cells[: len(_CPU_COLUMNS)])
            bus = " ".join(f"{cell:>10}" for cell in cells[len(_CPU_COLUMNS) :])
            lines.append(f"{concurrency:>5} {kind:>16} {cpu} {ratio:>9} {bus}")
    return "\n".join(lines)


def prompt_vocabulary(model: Path) -> list[int]:
    """The token ids a random prompt draws from: the checkpoint's tokenizer's, its special ones left out
    (the model's embedding may be larger than the tokenizer; a server refuses ids past the tokenizer)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    special = set(tokenizer.all_special_ids)
    return [token for token in range(len(tokenizer)) if token not in special]
