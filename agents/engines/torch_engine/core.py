"""The torch engine's model step, in the agent's process or in a process of its own.

What a step computes is plain data in and out: the scheduled sequences
(``SequenceWork``), which of them sample, their ``SamplingRow`` and the prompt
positions to score in; one token id per sampling row and the prompt scores
out. ``ModelCore`` computes it where it is built.
``CoreProcess`` computes it in a child process, the vLLM-v1 shape: the model
and its forward pass live there, the agent keeps scheduling, block tables and
the bus, and the two meet through a pipe (one pickled message each way per
step) and a KV pool in shared memory that both map. So the agent's event loop
(token deltas, load reports, requests arriving, migration handshakes) runs on
another core while a step computes, instead of taking turns with it for the
GIL, and a migration's export or import (a gather or scatter on the shared
pool, in the agent) runs beside the step.

The child is a new Python running this module's ``main`` (not a
``multiprocessing`` spawn, which would re-import the caller's main module),
talking over a socket pair. The pool is a file in ``/dev/shm`` that both map
and that is unlinked once both have it, so nothing is left behind however
either ends; its space is reserved up front, so a ``/dev/shm`` too small (a
container's default is 64 MiB) is an error at start, not a SIGBUS mid-step.
The child dies with its parent: the kernel sends it SIGKILL when the process
that started it exits (``PR_SET_PDEATHSIG``), it exits on the socket's end of
file, and ``close`` (or the engine being collected) stops it. A child that
fails (an exception in the step, or killed) surfaces as an ``EngineError`` in
the agent, which then stops stepping. CPU only: on CUDA the pool would have to
cross as an IPC handle, which is not built (``CoreProcess`` refuses a CUDA
device with a clear error).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from agents.engines.protocol import EngineError
from agents.engines.torch_engine.kv_cache import KVPoolShape, PagedKVPool, dtype_name, torch_dtype
from agents.engines.torch_engine.loader import load_model
from agents.engines.torch_engine.runner import ModelRunner, PromptScores, PromptScoring, SequenceWork
from agents.engines.torch_engine.sampling import SamplingRow, sample
from bus.heap import freeze_startup_heap
from schemas import Alternatives, SamplingParams

if TYPE_CHECKING:
    from agents.engines.torch_engine.config import ModelConfig

__all__ = ["Computed", "CoreProcess", "LoadedSpec", "ModelCore", "StepWork"]

#: The child's program: this module imported under its own name (so what it pickles unpickles here).
_CHILD = f"import sys; from {__name__} import main; main(sys.argv[1:])"
_FAILED = "engine core process: "
#: Seconds a child may take to import torch and build or load its model.
START_TIMEOUT_S = 600.0


#: What a step computed: a token id per sampling row, their logprobs and alternatives (see
#: ``SampleResult``), the seconds it took, and the prompt scores of the scored sequences (by index
#: in the step's work).
Computed = tuple[list[int], list[float | None], list[Alternatives | None], float, dict[int, PromptScores]]


@dataclass(frozen=True, slots=True)
class StepWork:
    """One step's computation: ``work`` in work order; ``sampled`` indexes the rows that pick a token;
    ``scoring``: the sequences (by index in ``work``) whose prompt positions are scored."""

    work: Sequence[SequenceWork]
    sampled: Sequence[int]
    rows: Sequence[SamplingRow]
    scoring: Mapping[int, PromptScoring] = field(default_factory=dict)

    def to_wire(self) -> tuple[Any, ...]:
        """Plain tuples (pickling the dataclasses costs ten times more: ~0.6 ms a 32-request step)."""
        params: dict[int, int] = {}  # id -> index: a request's params go once per step
        unique: list[SamplingParams] = []
        rows = []
        for row in self.rows:
            index = params.get(id(row.params))
            if index is None:
                index = params[id(row.params)] = len(unique)
                unique.append(row.params)
            rows.append((index, row.seed, row.output_index, tuple(row.history), tuple(row.banned_token_ids),
                         row.allowed))
        work = [(tuple(item.token_ids), item.start, tuple(item.block_ids)) for item in self.work]
        scoring = {i: (tuple(spec.targets), spec.k) for i, spec in self.scoring.items()}
        return work, tuple(self.sampled), rows, unique, scoring

    @classmethod
    def from_wire(cls, wire: tuple[Any, ...]) -> StepWork:
        work, sampled, rows, params, scoring = wire
        return cls(
            [SequenceWork(*item) for item in work],
            sampled,
            [SamplingRow(params[index], *rest) for index, *rest in rows],
            {i: PromptScoring(targets, k) for i, (targets, k) in scoring.items()},
        )


@dataclass(frozen=True, slots=True)
class LoadedSpec:
    """What the agent needs of a model it does not hold: its shape and identity."""

    config: ModelConfig
    model_id: str
    revision: str
    dtype: str


class ModelCore:
    """The model's forward pass and sampling over one pool, in this process."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def compute(self, step: StepWork) -> Computed:
        """The sampled token ids (one per ``step.sampled`` row), their logprobs where asked, the seconds."""
        started = time.perf_counter()
        logits, scores = self.runner.run(step.work, step.scoring)
        if len(step.sampled) < len(step.work):  # prompt chunks: their logits are not used
            logits = logits[list(step.sampled)]
        if not step.rows:
            return [], [], [], time.perf_counter() - started, scores
        result = sample(logits, step.rows)
        return result.token_ids, result.logprobs, result.top, time.perf_counter() - started, scores


@dataclass(frozen=True, slots=True)
class _CoreOptions:
    model: str
    seed: int
    dtype: str | None
    threads: int
    batch_invariant: bool
    max_pass_tokens: int


class CoreProcess:
    """A child process holding the model; see the module docstring.

    Built in two calls, because the pool's size depends on the model's shape:
    ``CoreProcess(...)`` starts the child and returns once its model is loaded
    (``spec``); ``shared_pool(shape, num_blocks)`` then makes the pool both map.
    Steps go one at a time.
    """

    def __init__(
        self,
        model: str,
        *,
        seed: int = 0,
        device: str = "cpu",
        dtype: str | None = None,
        threads: int | None = None,
        batch_invariant: bool = False,
        max_pass_tokens: int = 2048,
    ) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"the engine core process runs on CPU only, not {device!r}; use core='thread'")
        options = _CoreOptions(
            model=model,
            seed=seed,
            dtype=dtype,
            threads=torch.get_num_threads() if threads is None else threads,
            batch_invariant=batch_invariant,
            max_pass_tokens=max_pass_tokens,
        )
        ours, theirs = socket.socketpair()
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        self._conn = Connection(ours.detach())
        self._stale = 0  # replies of steps whose caller was cancelled, still to be read and dropped
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop, self._conn, self._process)
        try:
            self.spec: LoadedSpec = self._call(("load", options), timeout_s=START_TIMEOUT_S)
        except EngineError as exc:
            self.close()
            if str(exc).startswith(_FAILED):  # a bad model or dtype, as the in-process engine says it
                raise ValueError(str(exc).removeprefix(_FAILED)) from None
            raise

    @property
    def pid(self) -> int:
        return self._process.pid

    def shared_pool(self, shape: KVPoolShape, num_blocks: int) -> PagedKVPool:
        """A pool in shared memory that the child computes KV into and this process migrates from."""
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(directory, f"shoal-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        nbytes = num_blocks * shape.bytes_per_block
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)  # reserve it now: a full /dev/shm is a SIGBUS later
            except OSError as exc:
                raise RuntimeError(
                    f"cannot reserve a {nbytes / 2**20:.0f} MiB KV pool in {directory} ({exc.strerror}); "
                    "give it room (docker: --shm-size or --ipc=host), use a smaller --kv-cache-bytes, "
                    "or the thread engine core"
                ) from None
            os.close(fd)
            fd = -1
            pool = _map_pool(path, shape, num_blocks)
            self._call(("pool", (path, shape, num_blocks)), timeout_s=START_TIMEOUT_S)
        finally:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # both have it mapped (or it failed): nothing to leave behind
        return pool

    def compute(self, step: StepWork) -> Computed:
        """One step, waiting on this thread."""
        result: Computed = self._call(("step", step.to_wire()), timeout_s=None)
        return result

    async def compute_async(self, step: StepWork) -> Computed:
        """One step; the event loop runs on while the child computes."""
        self._send(("step", step.to_wire()))
        loop = asyncio.get_running_loop()
        readable: asyncio.Future[None] = loop.create_future()
        fd = self._conn.fileno()

        def on_readable() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(fd, on_readable)
        try:
            await readable  # end of file (a dead child) makes the socket readable too
        except asyncio.CancelledError:
            self._stale += 1
            raise
        finally:
            loop.remove_reader(fd)
        result: Computed = self._receive(timeout_s=None)
        return result

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the child (politely, then by force)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        _stop(self._conn, self._process, timeout_s)

    # ------------------------------------------------------------ the socket

    def _call(self, message: tuple[str, Any], *, timeout_s: float | None) -> Any:
        self._send(message)
        return self._receive(timeout_s=timeout_s)

    def _send(self, message: tuple[str, Any]) -> None:
        if self._closed:
            raise EngineError("the engine core process is closed")
        try:
            self._conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as exc:
            raise self._died() from exc

    def _receive(self, *, timeout_s: float | None) -> Any:
        while True:
            try:
                if timeout_s is not None and not self._conn.poll(timeout_s):
                    raise EngineError(f"the engine core process did not answer within {timeout_s:g} s")
                kind, payload = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError) as exc:
                raise self._died() from exc
            if self._stale:
                self._stale -= 1
                continue
            if kind == "error":
                raise EngineError(f"{_FAILED}{payload}")
            return payload

    def _died(self) -> EngineError:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(1.0)
        return EngineError(f"the engine core process exited (exit code {self._process.returncode})")


def _map_pool(path: str, shape: KVPoolShape, num_blocks: int) -> PagedKVPool:
    """The pool over the shared file at ``path`` (``MAP_SHARED``: writes are seen by every process)."""
    dtype = torch_dtype(shape.dtype)
    numel = num_blocks * shape.bytes_per_block // dtype.itemsize
    flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    return PagedKVPool.from_tensor(shape, flat.view(num_blocks, *shape.block_dims))


def _stop(conn: Connection, process: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    with contextlib.suppress(OSError, ValueError):
        conn.send_bytes(pickle.dumps(("stop", None)))
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout_s)
    with contextlib.suppress(OSError):
        conn.close()


def _die_with_parent(parent: int) -> None:
    """Have Linux kill this process when its parent dies, whatever the parent died of."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        os._exit(0)


def _serve(conn: Connection) -> None:  # pragma: no cover - runs in the child
    """The child: load the model, map the pool, then compute steps until told to stop or orphaned."""
    loaded = None
    core: ModelCore | None = None
    while True:
        try:
            kind, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent is gone
        if kind == "stop":
            return
        try:
            if kind == "load":
                options: _CoreOptions = payload
                torch.set_num_threads(options.threads)
                loaded = load_model(options.model, device="cpu", dtype=options.dtype, seed=options.seed)
                dtype = dtype_name(loaded.model.dtype)
                spec = LoadedSpec(loaded.config, loaded.model_id, loaded.revision, dtype)
                reply: tuple[str, Any] = ("ok", spec)
            elif kind == "pool" and loaded is not None:
                runner = ModelRunner(
                    loaded.model,
                    _map_pool(*payload),
                    batch_invariant=options.batch_invariant,
                    max_pass_tokens=options.max_pass_tokens,
                )
                core = ModelCore(runner)
                freeze_startup_heap()  # torch and the model: out of the full collections that stall steps
                reply = ("ok", None)
            elif kind == "step" and core is not None:
                reply = ("ok", core.compute(StepWork.from_wire(payload)))
            else:
                reply = ("error", f"unexpected message {kind!r}")
        except Exception as exc:
            detail = traceback.format_exc(limit=8) if kind == "step" else f"{type(exc).__name__}: {exc}"
            reply = ("error", detail)
        try:
            conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            return


def main(argv: Sequence[str]) -> None:  # pragma: no cover - runs in the child
    fd, parent = int(argv[0]), int(argv[1])
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    _serve(Connection(fd))
