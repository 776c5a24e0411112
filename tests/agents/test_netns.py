"""Two agents on two "hosts" (Linux network namespaces) migrate a request over TCP by advertised address.

Each agent runs as ``shoal agent`` inside its own namespace, binds its KV
transport to ``0.0.0.0`` and advertises its namespace's address
(``--transport-advertise``); NATS listens on a bridge in the root namespace.
A request generating on the first is migrated to the second mid-stream: the
client sees every token once, the later ones from the second agent, and the
addresses in the agents' join events are the advertised ones. Needs root and
``ip netns`` (skipped otherwise, with the reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus import JetStreamBus
from bus.server import EmbeddedNats
from schemas import GenerateRequest, MigrateOut, SamplingParams, Subjects
from tests.agents.agent_cluster import AgentCluster, bus_config

pytestmark = pytest.mark.slow


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def _two_hosts() -> Iterator[tuple[str, dict[str, tuple[str, str]]]]:
    """A bridge (the root namespace's address) and two namespaces on it: (bridge ip, {name: (ns, ip)})."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("the ip command (iproute2) is not installed")
    tag = uuid.uuid4().hex[:6]
    net = f"10.{random.randint(100, 250)}.{random.randint(1, 250)}"
    bridge = f"shbr{tag}"
    hosts = {"h1": (f"shoal{tag}h1", f"{net}.2"), "h2": (f"shoal{tag}h2", f"{net}.3")}
    try:
        _ip("link", "add", bridge, "type", "bridge")
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a bridge here: {exc.stderr.strip()}")
    created: list[str] = []
    try:
        _ip("addr", "add", f"{net}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for index, (namespace, address) in enumerate(hosts.values()):
            _ip("netns", "add", namespace)
            created.append(namespace)
            outside, inside = f"sh{tag}o{index}", f"sh{tag}i{index}"
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", namespace)
            _ip("link", "set", outside, "master", bridge, "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", inside)
            _ip("-n", namespace, "link", "set", inside, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        yield f"{net}.1", hosts
    finally:
        for namespace in created:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", namespace)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", bridge)


async def _wait_file(
    path: Path, process: subprocess.Popen[bytes], log: Path, timeout: float = 60
) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return json.loads(path.read_text())  # type: ignore[no-any-return]
        if process.poll() is not None:
            raise AssertionError(f"agent exited with {process.returncode}:\n{log.read_text()[-2000:]}")
        await asyncio.sleep(0.1)
    raise AssertionError(f"agent not ready:\n{log.read_text()[-2000:]}")


async def test_agents_in_two_namespaces_migrate_over_tcp_by_advertised_address(tmp_path: Path) -> None:
    with _two_hosts() as (bridge_ip, hosts):
        with EmbeddedNats(host=bridge_ip) as nats:
            subjects = Subjects(f"t{uuid.uuid4().hex[:10]}")
            processes: list[subprocess.Popen[bytes]] = []
            try:
                ready = {}
                for name, (namespace, address) in hosts.items():
                    log = tmp_path / f"{name}.log"
                    with log.open("wb") as out:
                        process = subprocess.Popen(
                            [
                                "ip",
                                "netns",
                                "exec",
                                namespace,
                                sys.executable,
                                "-c",
                                "from frontend.cli import main; main()",
                                "agent",
                                "--nats",
                                nats.url,
                                "--prefix",
                                subjects.prefix,
                                "--instance-id",
                                name,
                                "--engine",
                                "sim",
                                "--profile",
                                "tiny-test",
                                "--time-scale",
                                "4",
                                "--transport",
                                "tcp",
                                "--transport-host",
                                "0.0.0.0",
                                "--transport-advertise",
                                address,
                                "--ready-file",
                                str(tmp_path / f"{name}.ready"),
                            ],
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                        )
                    processes.append(process)
                for (name, (_, address)), process in zip(hosts.items(), processes, strict=True):
                    ready[name] = await _wait_file(
                        tmp_path / f"{name}.ready", process, tmp_path / f"{name}.log"
                    )
                    assert ready[name]["transport_address"].startswith(
                        f"tcp://{address}:"
                    )  # advertised, not 0.0.0.0
                client = JetStreamBus(bus_config(nats.url, subjects, "client"))
                await client.connect()
                cluster = AgentCluster(url=nats.url, subjects=subjects, client=client)
                try:
                    watcher = await cluster.watch("r1")
                    sampling = SamplingParams(max_tokens=200, ignore_eos=True)
                    request = GenerateRequest(
                        request_id="r1", token_ids=tuple(range(1, 41)), sampling=sampling
                    )
                    assert (await cluster.generate("h1", request, timeout=10)).accepted
                    await watcher.wait_tokens(5, timeout=60)
                    reply = await cluster.call(
                        "h1",
                        "migrate_out",
                        MigrateOut(epoch=1, destination_id="h2", target_freeness=99.0),
                        timeout=10,
                    )
                    assert reply.accepted, reply
                    await watcher.wait_finished(timeout=60)
                    tokens = watcher.tokens()  # every index once
                    assert len(tokens) == 200
                    by = {(d.instance_id, d.owner_epoch) for d in watcher.deltas}
                    assert ("h1", 0) in by and ("h2", 1) in by, by
                    joined = {
                        env.body.instance_id: env.body.transport_address
                        for _, env in await cluster.stored(f"{subjects.prefix}.ev.instance.*")
                        if hasattr(env.body, "transport_address")
                    }
                    assert joined == {name: ready[name]["transport_address"] for name in hosts}
                    await watcher.close()
                finally:
                    await client.close()
            finally:
                for process in processes:
                    process.terminate()
                for process in processes:
                    try:
                        process.wait(15)
                    except subprocess.TimeoutExpired:
                        process.kill()
                        process.wait()
