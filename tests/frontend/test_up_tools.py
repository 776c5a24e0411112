"""``shoal up --tool-call-parser`` reaches the frontend it starts: ``tool_choice`` auto works there."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from bus.server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
            },
        },
    }
]
#: makes the sim engine's random model write a call in the hermes format (structured_outputs beside auto)
CALL = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>'


async def test_shoal_up_passes_the_tool_call_parser_to_its_frontend(tmp_path: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from frontend.cli import main; main()",
            "up",
            "--engine",
            "sim",
            "--instances",
            "1",
            "--no-scheduler",
            "--port",
            str(port),
            "--log-dir",
            str(tmp_path / "logs"),
            "--tool-call-parser",
            "hermes",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    lines: list[str] = []
    try:
        for line in process.stdout:
            lines.append(line.rstrip())
            if line.startswith("shoal is serving"):
                break
        assert lines and lines[-1].startswith("shoal is serving"), "\n".join(lines)
        async with openai.AsyncOpenAI(
            api_key="none", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0, timeout=30
        ) as client:
            reply = await client.chat.completions.create(
                model="sim:tiny-test",
                messages=[{"role": "user", "content": "time?"}],
                tools=TOOLS,
                max_tokens=100,
                extra_body={"structured_outputs": {"regex": CALL}},
            )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        finally:
            process.stdout.close()
