"""The supervisor of ``shoal up`` and the drill's cluster, pure: restart with backoff, give up on a
crash loop, name the exit, and the reason ``/health`` shows.

The policy (:func:`frontend.supervisor.decide`) over exit histories; the
:class:`~frontend.supervisor.Supervisor` over fake children and a fake clock
(a failed child is started again after its delay, a child that exits 0 is not,
one that crash-loops is left down with its signal, log tail and advice); and
``/health``'s body with a supervisor's status file.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from frontend.board import LoadBoard
from frontend.routes.health import NO_INSTANCE_READY, health_body
from frontend.supervisor import (
    GiveUp,
    Restart,
    RestartPolicy,
    Supervisor,
    advice,
    decide,
    describe_exit,
    read_status,
    write_status,
)
from schemas.position import Position
from tests.frontend.test_board import _joined, _report


def test_backoff_doubles_per_exit_in_the_window_up_to_the_cap() -> None:
    policy = RestartPolicy(initial_delay_s=1.0, max_delay_s=30.0, max_restarts=10, window_s=600.0)
    exits: list[float] = []
    delays = []
    for at in range(7):
        exits.append(float(at))
        decision = decide(policy, exits, float(at))
        assert isinstance(decision, Restart)
        delays.append(decision.delay_s)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_a_child_that_keeps_crashing_within_the_window_is_given_up_on() -> None:
    policy = RestartPolicy(max_restarts=5, window_s=60.0)
    exits = [0.0, 5.0, 12.0, 25.0]
    assert decide(policy, exits, 25.0) == Restart(delay_s=8.0)
    assert decide(policy, [*exits, 40.0], 40.0) == GiveUp(exits=5, window_s=60.0)


def test_exits_older_than_the_window_are_forgotten_so_the_backoff_resets() -> None:
    policy = RestartPolicy(max_restarts=3, window_s=60.0)
    # two exits an hour ago, then one now: a first failure again (1 s), not a third (given up)
    assert decide(policy, [0.0, 10.0, 3600.0], 3600.0) == Restart(delay_s=1.0)


def test_a_policy_that_cannot_work_is_refused() -> None:
    with pytest.raises(ValueError):
        RestartPolicy(initial_delay_s=10.0, max_delay_s=1.0)
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=0)


def test_an_exit_is_named_by_its_signal_and_says_what_it_likely_means() -> None:
    assert describe_exit(-signal.SIGILL).startswith("SIGILL (illegal instruction")
    assert describe_exit(-signal.SIGKILL) == "SIGKILL (killed, perhaps by the OOM killer)"
    assert describe_exit(-signal.SIGSEGV) == "SIGSEGV (segmentation fault)"
    assert describe_exit(3) == "exit code 3"
    assert "--dtype float32" in advice("agent-0", -signal.SIGILL, engine="vllm")
    assert "--dtype float32" not in advice("agent-0", -signal.SIGILL, engine="sim")
    assert "OOM" in advice("scheduler", -signal.SIGKILL)


@dataclass
class FakeChild:
    name: str
    pid: int
    log_path: Path
    code: int | None = None

    def exit_code(self) -> int | None:
        return self.code


@dataclass
class FakeCluster:
    log_path: Path
    started: list[FakeChild] = field(default_factory=list)

    def spawn(self, name: str) -> FakeChild:
        child = FakeChild(name, 100 + len(self.started), self.log_path)
        self.started.append(child)
        return child


def test_a_failed_child_is_started_again_after_its_delay_and_left_down_when_it_crash_loops(
    tmp_path: Path,
) -> None:
    log = tmp_path / "agent-0.log"
    log.write_text("".join(f"line {i}\n" for i in range(40)) + "Illegal instruction (core dumped)\n")
    cluster = FakeCluster(log)
    now = [0.0]
    policy = RestartPolicy(initial_delay_s=1.0, max_delay_s=4.0, max_restarts=3, window_s=60.0)
    supervisor = Supervisor(policy, cluster.spawn, engine="vllm", clock=lambda: now[0])
    supervisor.watch(cluster.spawn("agent-0"))
    assert supervisor.poll() == []  # running: nothing to do

    cluster.started[-1].code = -signal.SIGILL
    notices = supervisor.poll()
    assert [n.kind for n in notices] == ["exited"]
    assert "SIGILL" in notices[0].detail and "restarting in 1s" in notices[0].detail
    now[0] = 0.5
    assert supervisor.poll() == [] and len(cluster.started) == 1  # the delay is not over
    now[0] = 1.0
    assert [n.kind for n in supervisor.poll()] == ["restarted"]
    assert len(cluster.started) == 2 and supervisor.child("agent-0") is cluster.started[1]

    cluster.started[-1].code = -signal.SIGILL
    now[0] = 5.0
    assert "restarting in 2s" in supervisor.poll()[0].detail
    now[0] = 7.0
    supervisor.poll()
    cluster.started[-1].code = -signal.SIGILL
    now[0] = 10.0
    notices = supervisor.poll()
    assert [n.kind for n in notices] == ["left_down"]
    left = notices[0].left_down
    assert left is not None and supervisor.left_down == [left]
    assert left.reason.startswith("agent-0 exited 3 times within 60s, last with SIGILL")
    assert "--dtype float32" in left.reason
    message = left.message()
    assert "Illegal instruction (core dumped)" in message and str(log) in message
    assert "line 0\n" not in message  # the tail, not the whole log
    now[0] = 100.0
    assert supervisor.poll() == [] and len(cluster.started) == 3  # left down: never started again


def test_a_child_that_exits_with_code_0_stopped_on_its_own_and_is_not_restarted(tmp_path: Path) -> None:
    cluster = FakeCluster(tmp_path / "agent-1.log")
    supervisor = Supervisor(RestartPolicy(initial_delay_s=0.0), cluster.spawn, clock=lambda: 0.0)
    supervisor.watch(cluster.spawn("agent-1"))
    cluster.started[-1].code = 0  # drained on SIGTERM and left
    assert [n.kind for n in supervisor.poll()] == ["stopped"]
    assert supervisor.poll() == [] and len(cluster.started) == 1 and supervisor.left_down == []


def test_health_carries_the_supervisors_reason(tmp_path: Path) -> None:
    cluster = FakeCluster(tmp_path / "agent-0.log")
    supervisor = Supervisor(RestartPolicy(max_restarts=1), cluster.spawn, engine="torch", clock=lambda: 0.0)
    supervisor.watch(cluster.spawn("agent-0"))
    cluster.started[-1].code = -signal.SIGILL
    supervisor.poll()
    status = tmp_path / "supervisor.json"
    write_status(status, supervisor.left_down)
    left_down = read_status(status)
    assert list(left_down) == ["agent-0"]

    board = LoadBoard(stale_after=3.0)
    code, body = health_body(board, 0.0, left_down)
    assert code == 503
    assert body["reason"].startswith(NO_INSTANCE_READY) and "SIGILL" in body["reason"]
    assert "--dtype float32" in body["left_down"]["agent-0"]

    board.observe(Position("ev", 1), _joined("b"), now=0.0)  # another instance serves: 200, still listed
    board.observe(Position("loads", 1), _report("b", 1, used_blocks=0, running=0), now=0.0)
    code, body = health_body(board, 0.0, left_down)
    assert code == 200 and "SIGILL" in body["left_down"]["agent-0"]


def test_without_a_supervisor_health_has_no_such_reason(tmp_path: Path) -> None:
    assert read_status(None) == {}
    assert read_status(tmp_path / "absent.json") == {}
    (tmp_path / "torn.json").write_text("{")
    assert read_status(tmp_path / "torn.json") == {}
    code, body = health_body(LoadBoard(stale_after=3.0), 0.0, read_status(None))
    assert code == 503 and "left_down" not in body


def test_shoal_up_declares_the_policy_and_passes_its_hidden_fault_to_every_agent() -> None:
    from click.testing import CliRunner

    from bus.cli_config import ConfigError, to_argv
    from bus.options import NatsOptions
    from frontend.up import UpConfig, agent_config, up

    help_text = CliRunner().invoke(up, ["--help"]).output
    assert "--restart-limit" in help_text and "--restart-window" in help_text
    assert "--fault-first-step" not in help_text  # a test's fault, not a user's option
    config = UpConfig(engine="sim", fault_first_step="exit", restart_delay=2.0, restart_limit=3)
    assert config.restart_policy == RestartPolicy(initial_delay_s=2.0, max_delay_s=30.0, max_restarts=3,
                                                  window_s=60.0)
    argv = to_argv(agent_config(config, NatsOptions(), "agent-0"))
    assert argv[argv.index("--fault-first-step") + 1] == "exit"
    assert "--fault-first-step" not in to_argv(agent_config(UpConfig(engine="sim"), NatsOptions(), "agent-0"))
    with pytest.raises(ConfigError):
        UpConfig(restart_delay=10.0, restart_max_delay=5.0)
