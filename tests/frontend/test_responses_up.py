"""``shoal up``'s frontend killed with SIGKILL between two turns of a Responses API conversation:
the supervisor restarts it, the stored response is found and the conversation continues through
``previous_response_id`` (official ``openai`` client, sim engine)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from bus.server import free_port
from tests.frontend.test_up_supervision import Up, _restarted_pids, _wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MODEL = "sim:tiny-test"


async def test_a_conversation_continues_after_the_frontend_is_killed_and_restarted(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    up = Up(
        [
            "--engine",
            "sim",
            "--instances",
            "1",
            "--port",
            str(port),
            "--restart-delay",
            "0.5",
            "--ready-timeout",
            "120",
        ],
        tmp_path / "logs",
    )
    try:
        up.wait_line(r"^shoal is serving", 150)
        frontend = up.pid("frontend")
        client = openai.AsyncOpenAI(api_key="none", base_url=f"{url}/v1", max_retries=0, timeout=60.0)
        first = await client.responses.create(
            model=MODEL, input="Hello there", max_output_tokens=8, temperature=0
        )
        os.kill(frontend, signal.SIGKILL)
        up.wait_line(rf"^frontend \(pid {frontend}\) exited with SIGKILL", 10)
        up.wait_line(r"^frontend restarted \(pid \d+\)", 30)
        assert _restarted_pids(up, "frontend")
        async with httpx.AsyncClient(timeout=10.0) as http:
            await _wait_ready(http, url, 1, 60)
        deadline = time.monotonic() + 30
        while True:  # the new frontend serves once its lifespan connected
            try:
                stored = await client.responses.retrieve(first.id)
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the restarted frontend did not answer within 30 s"
                await asyncio.sleep(0.2)
        assert stored.output_text == first.output_text
        second = await client.responses.create(
            model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=8, temperature=0
        )
        assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        await client.close()
    finally:
        up.stop()
    assert up.process.returncode == 0, up.output
