"""The test tiers hold: every test gets one tier, and a test that does what its tier rules out fails.

Each case runs a pytest session of its own (``pytester``) on a small test file with
``tests/tiers.py`` as its plugin and a stand-in ``nats_url`` fixture.
"""

from __future__ import annotations

import pytest

# the sessions run here start processes of their own: e2e, where nothing is guarded
pytestmark = pytest.mark.e2e

CONFTEST = """
import pytest

pytest_plugins = ["tests.tiers"]


@pytest.fixture
def nats_url() -> str:
    return "nats://127.0.0.1:1"


@pytest.fixture
def client(nats_url: str) -> str:
    return nats_url
"""

TESTS = """
import socket
import subprocess

import pytest


def test_pure() -> None:
    assert sorted([2, 1]) == [1, 2]


def test_starts_a_process() -> None:
    subprocess.run(["true"], check=True)


def test_hides_the_process_it_tried() -> None:
    try:
        subprocess.run(["true"], check=True)
    except Exception:
        pass


def test_listens() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()


def test_on_nats(client: str) -> None:
    assert client.startswith("nats://")


def test_on_nats_starts_a_process(nats_url: str) -> None:
    subprocess.run(["true"], check=True)


@pytest.mark.e2e
def test_declared_e2e() -> None:
    subprocess.run(["true"], check=True)
"""


def _session(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner=TESTS)
    return pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", "-p", "no:asyncio", *args)


def test_each_test_gets_the_tier_its_fixtures_and_markers_give_it(pytester: pytest.Pytester) -> None:
    names = {}
    for tier in ("unit", "integration", "e2e"):
        lines = _session(pytester, "--collect-only", "-m", tier).outlines
        names[tier] = sorted(line.split("::")[1] for line in lines if "::" in line)
    assert names == {
        "unit": ["test_hides_the_process_it_tried", "test_listens", "test_pure", "test_starts_a_process"],
        "integration": ["test_on_nats", "test_on_nats_starts_a_process"],  # client depends on nats_url
        "e2e": ["test_declared_e2e"],
    }


def test_a_test_that_does_what_its_tier_rules_out_fails_and_says_so(pytester: pytest.Pytester) -> None:
    result = _session(pytester, "-rf")
    result.assert_outcomes(passed=3, failed=4)
    failed = {line.split("::")[1].split(" ")[0] for line in result.outlines if line.startswith("FAILED")}
    assert failed == {
        "test_starts_a_process",
        "test_hides_the_process_it_tried",  # caught by the test: it fails all the same
        "test_listens",
        "test_on_nats_starts_a_process",
    }
    result.stdout.fnmatch_lines([
        "*test_starts_a_process (unit tier) started a process ('true')*",
        "*test_listens (unit tier) opened a listening socket*",
        "*test_on_nats_starts_a_process (integration tier) started a process ('true')*",
    ])
