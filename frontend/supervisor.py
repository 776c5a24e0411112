"""Supervision of a local cluster's processes: restart with backoff, give up on a crash loop.

The policy is pure: :func:`decide` takes a child's recent unexpected exits (their
monotonic times) and says whether to start it again after a delay
(:class:`Restart`: 1 s, doubling per exit in the window, capped) or to leave it
down (:class:`GiveUp`: it exited ``max_restarts`` times within ``window_s``), as
systemd's ``Restart=on-failure`` with ``StartLimitBurst`` or a Kubernetes
controller's ``CrashLoopBackOff`` would. :func:`describe_exit` names an exit
status (a signal by its name: ``SIGILL``, ``SIGKILL`` — perhaps the OOM killer —,
``SIGSEGV``, or the exit code) and :func:`advice` says what to try.

:class:`Supervisor` is the thin shell ``shoal up`` and the drill's cluster run:
it polls its children, restarts one that failed (a signal or a non-zero exit
code; one that exits with 0 stopped on its own, as an agent does after a
drain, and is not restarted) when the policy says so through a ``respawn``
callable, and returns what happened as :class:`Notice` records (the caller
prints them). :func:`write_status` / :func:`read_status` keep the
children left down, with their reasons, in a small JSON file that ``shoal up``
hands the frontend (``shoal serve --supervisor-status``), so ``/health`` says why
an instance is gone. Without a supervisor there is no file and no such reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

__all__ = [
    "Decision",
    "GiveUp",
    "LeftDown",
    "Notice",
    "Restart",
    "RestartPolicy",
    "Supervised",
    "Supervisor",
    "advice",
    "decide",
    "describe_exit",
    "read_status",
    "write_status",
]


@dataclass(frozen=True)
class RestartPolicy:
    """When a child that exited is started again, and when it is left down.

    The n-th exit within ``window_s`` (n counted from 1) is followed by a restart after
    ``min(max_delay_s, initial_delay_s * 2 ** (n - 1))``; the ``max_restarts``-th exit within
    ``window_s`` leaves the child down.
    """

    initial_delay_s: float = 1.0
    max_delay_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.initial_delay_s < 0 or self.max_delay_s < self.initial_delay_s:
            raise ValueError("need 0 <= initial_delay_s <= max_delay_s")
        if self.max_restarts < 1 or self.window_s <= 0:
            raise ValueError("need max_restarts >= 1 and window_s > 0")


@dataclass(frozen=True)
class Restart:
    """Start the child again after ``delay_s``."""

    delay_s: float


@dataclass(frozen=True)
class GiveUp:
    """Leave the child down: it exited ``exits`` times within ``window_s``."""

    exits: int
    window_s: float


Decision = Restart | GiveUp


def decide(policy: RestartPolicy, exits: Sequence[float], now: float) -> Decision:
    """What to do about a child whose unexpected exits happened at ``exits`` (monotonic seconds,
    the latest one included), at ``now``."""
    recent = sum(1 for at in exits if now - at <= policy.window_s)
    if recent >= policy.max_restarts:
        return GiveUp(exits=recent, window_s=policy.window_s)
    delay = policy.initial_delay_s * 2 ** max(0, recent - 1)
    return Restart(delay_s=min(policy.max_delay_s, delay))


_SIGNAL_MEANING = {
    signal.SIGILL: "illegal instruction: the CPU or the kernel refused an instruction the code uses",
    signal.SIGKILL: "killed, perhaps by the OOM killer",
    signal.SIGSEGV: "segmentation fault",
    signal.SIGBUS: "bus error",
    signal.SIGABRT: "aborted",
    signal.SIGFPE: "arithmetic fault",
    signal.SIGTERM: "terminated",
    signal.SIGINT: "interrupted",
}


def describe_exit(returncode: int) -> str:
    """An exit status in words: ``SIGILL (illegal instruction: ...)``, ``exit code 1``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        sig = signal.Signals(-returncode)
    except ValueError:
        return f"signal {-returncode}"
    meaning = _SIGNAL_MEANING.get(sig)
    return f"{sig.name} ({meaning})" if meaning else sig.name


def advice(name: str, returncode: int, *, engine: str = "") -> str:
    """What to try about child ``name`` (``agent-0``, ``scheduler``, ...) that exited so."""
    is_agent = name.startswith("agent") or name.startswith("inst-")
    if returncode == -signal.SIGILL and is_agent and engine in ("vllm", "torch"):
        return ("try --dtype float32: the CPU or the kernel refused an instruction the model's "
                "kernels use at the default dtype")
    if returncode == -signal.SIGKILL:
        return ("check the kernel log for the OOM killer (dmesg); fewer --instances or less KV "
                "space (--num-blocks, --kv-cache-bytes) need less memory")
    return "see its log for the cause"


class Supervised(Protocol):
    """A child process as the supervisor sees it."""

    @property
    def name(self) -> str: ...

    @property
    def pid(self) -> int: ...

    @property
    def log_path(self) -> Path: ...

    def exit_code(self) -> int | None:
        """None while it runs."""
        ...


@dataclass(frozen=True)
class LeftDown:
    """A child the supervisor gave up on, and why (what ``/health`` reports)."""

    name: str
    returncode: int
    exits: int
    window_s: float
    log_path: Path
    log_tail: str
    advice: str

    @property
    def reason(self) -> str:
        return (f"{self.name} exited {self.exits} times within {self.window_s:g}s, last with "
                f"{describe_exit(self.returncode)}; left down ({self.advice})")

    def message(self) -> str:
        """The reason, the last lines of the log and where the log is (for a terminal)."""
        if not self.log_tail.strip():
            return f"{self.reason}\n{self.log_path} is empty"
        tail = "\n".join(f"  | {line}" for line in self.log_tail.splitlines())
        return f"{self.reason}\nlast lines of {self.log_path}:\n{tail}"


@dataclass(frozen=True)
class Notice:
    """What the supervisor did about one child: ``exited`` (a restart is due), ``restarted`` (a new
    pid), ``stopped`` (exit code 0: it ended on its own, no longer supervised) or ``left_down``
    (``left_down`` says why)."""

    kind: str
    name: str
    detail: str
    left_down: LeftDown | None = None


def _tail(path: Path, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


@dataclass
class _Watch:
    child: Supervised
    exits: list[float] = field(default_factory=list)
    restart_at: float | None = None
    left_down: LeftDown | None = None


class Supervisor:
    """Restarts the children it watches per ``policy``; :meth:`poll` says what it did.

    ``respawn(name)`` starts child ``name`` again (the same command line) and returns it;
    ``engine`` (the agents' engine) picks the advice. ``clock`` is monotonic seconds.
    """

    def __init__(
        self,
        policy: RestartPolicy,
        respawn: Callable[[str], Supervised],
        *,
        engine: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self._respawn = respawn
        self.engine = engine
        self._clock = clock
        self._watches: dict[str, _Watch] = {}

    def watch(self, child: Supervised) -> None:
        """Supervise ``child`` (replacing an earlier process of the same name)."""
        previous = self._watches.get(child.name)
        self._watches[child.name] = _Watch(child, exits=previous.exits if previous else [])

    def forget(self, name: str) -> None:
        """Stop supervising ``name`` (it is stopped on purpose)."""
        self._watches.pop(name, None)

    def child(self, name: str) -> Supervised | None:
        watch = self._watches.get(name)
        return watch.child if watch is not None else None

    @property
    def left_down(self) -> list[LeftDown]:
        return [w.left_down for w in self._watches.values() if w.left_down is not None]

    def pending_restart(self, name: str) -> bool:
        watch = self._watches.get(name)
        return watch is not None and watch.restart_at is not None

    def poll(self) -> list[Notice]:
        """Look at every child once: record exits, decide, start those whose delay is over."""
        notices: list[Notice] = []
        now = self._clock()
        for name, watch in list(self._watches.items()):
            if watch.left_down is not None:
                continue
            if watch.restart_at is None:
                code = watch.child.exit_code()
                if code is None:
                    continue
                if code == 0:  # it stopped on its own (an agent drained on SIGTERM): not a failure
                    del self._watches[name]
                    notices.append(Notice("stopped", name, f"{name} (pid {watch.child.pid}) exited with "
                                                           "code 0; not restarted"))
                    continue
                watch.exits.append(now)
                decision = decide(self.policy, watch.exits, now)
                what = f"{name} (pid {watch.child.pid}) exited with {describe_exit(code)}"
                if isinstance(decision, GiveUp):
                    watch.left_down = LeftDown(
                        name=name, returncode=code, exits=decision.exits, window_s=decision.window_s,
                        log_path=watch.child.log_path, log_tail=_tail(watch.child.log_path),
                        advice=advice(name, code, engine=self.engine),
                    )
                    notices.append(Notice("left_down", name, what, watch.left_down))
                    continue
                watch.restart_at = now + decision.delay_s
                notices.append(Notice("exited", name, f"{what}; restarting in {decision.delay_s:g}s"))
            if watch.restart_at is not None and now >= watch.restart_at:
                watch.child = self._respawn(name)
                watch.restart_at = None
                notices.append(Notice("restarted", name, f"{name} restarted (pid {watch.child.pid})"))
        return notices


def write_status(path: Path, left_down: Sequence[LeftDown]) -> None:
    """Replace ``path`` with the children left down (atomic: a reader sees the old or the new file)."""
    body = {"left_down": {d.name: d.reason for d in left_down}}
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(body))
    os.replace(partial, path)


def read_status(path: Path | None) -> dict[str, str]:
    """The children left down and why, from a :func:`write_status` file ({} if none or unreadable)."""
    if path is None:
        return {}
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    left = body.get("left_down") if isinstance(body, dict) else None
    return {str(k): str(v) for k, v in left.items()} if isinstance(left, dict) else {}
