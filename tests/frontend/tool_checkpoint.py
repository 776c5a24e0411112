"""A checkpoint folder whose chat template renders tools, for the tool calling tests.

The random Llama of :func:`agents.engines.vllm_engine.checkpoint.build_checkpoint`
with :data:`HERMES_TOOL_TEMPLATE` as its chat template: Qwen 2.5's template
(tools listed in the system turn, calls as ``<tool_call>`` JSON, results in
``<tool_response>`` blocks), which the ``hermes`` tool call parser reads.
"""

from __future__ import annotations

import json
from pathlib import Path

from agents.engines.vllm_engine.checkpoint import CheckpointSpec, build_checkpoint

__all__ = ["HERMES_TOOL_TEMPLATE", "build_tool_checkpoint"]

HERMES_TOOL_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments " }}
    {{- "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n" }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or
          (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def build_tool_checkpoint(folder: str | Path) -> Path:
    """The random Llama checkpoint in ``folder`` with :data:`HERMES_TOOL_TEMPLATE` as its chat template
    and a 4096-token context (its small tokenizer makes a prompt with tools about 1,000 tokens)."""
    path = build_checkpoint(folder, CheckpointSpec(max_position_embeddings=4096))
    settings_path = path / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text())
    settings["chat_template"] = HERMES_TOOL_TEMPLATE
    settings_path.write_text(json.dumps(settings, indent=1))
    return path
