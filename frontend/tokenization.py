"""Turning OpenAI prompts and chat messages into token ids; the frontend's tokenizer.

The frontend tokenizes (agents see token ids only) with the same tokenizer
the engine's model uses: :func:`load_frontend_tokenizer` takes the model spec
of ``shoal up`` / ``shoal serve`` — a torch preset (byte tokenizer), a
checkpoint folder (its ``tokenizer.json`` and chat template) or
``sim:<profile>`` (a byte tokenizer over the profile's vocabulary). Chat
messages (with their tool calls and tool results) and function tools are
rendered with the tokenizer's chat template (a simple role-tagged default
for the byte tokenizer, which shows no tools).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from agents.engines.tokenizer import ByteTokenizer, TextTokenizer, load_tokenizer, render_chat
from frontend.errors import APIError, invalid_parameter
from frontend.openai_models import ChatMessage

__all__ = ["chat_prompt_ids", "completion_prompt_ids", "encode_text", "load_frontend_tokenizer", "token_text"]


def load_frontend_tokenizer(model: str) -> TextTokenizer:
    """The tokenizer for a model spec; ``sim:<profile>`` gives a byte tokenizer of that vocabulary."""
    if model.startswith("sim:") or model == "sim":
        from agents.engines.profile import load_profile

        name = model.partition(":")[2] or "tiny-test"
        return ByteTokenizer(max(load_profile(name).vocab_size, 259))
    return load_tokenizer(model)


def encode_text(
    tokenizer: TextTokenizer, text: str, param: str, *, add_special_tokens: bool = True
) -> list[int]:
    """``tokenizer.encode`` of valid Unicode only: JSON can carry a lone surrogate, UTF-8 cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise invalid_parameter(
            f"{param} is not valid Unicode: a lone surrogate (U+{ord(bad):04X}) at character {exc.start}",
            param,
        ) from exc
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def completion_prompt_ids(tokenizer: TextTokenizer, prompt: Any) -> list[list[int]]:
    """Token ids of each prompt of a completions ``prompt``: a string, token ids, or a list of those."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if not all(isinstance(p, str | list) for p in prompt):
            raise invalid_parameter("a list of prompts holds strings or lists of token ids only", "prompt")
        return [_one_prompt(tokenizer, p) for p in prompt]
    return [_one_prompt(tokenizer, prompt)]


def _one_prompt(tokenizer: TextTokenizer, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        ids = encode_text(tokenizer, prompt, "prompt")
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
        vocab = tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise invalid_parameter(f"prompt token ids must be in [0, {vocab})", "prompt")
    else:
        raise invalid_parameter("prompt must be a string or token ids", "prompt")
    if not ids:
        raise invalid_parameter("the prompt is empty", "prompt")
    return ids


def _content_text(message: ChatMessage) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise invalid_parameter(f"content parts of type {part.type!r} are not supported", "messages")
        parts.append(part.text)
    return "".join(parts)


def _message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: tool calls' arguments as objects (as vLLM passes them)."""
    rendered: dict[str, Any] = {"role": message.role, "content": _content_text(message)}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
            except ValueError as exc:
                raise invalid_parameter(
                    f"the arguments of tool call {call.id!r} are not JSON: {exc}", "messages"
                ) from exc
            function = {"name": call.function.name, "arguments": arguments}
            calls.append({"id": call.id, "type": call.type, "function": function})
        rendered["tool_calls"] = calls
    return rendered


def chat_prompt_ids(
    tokenizer: TextTokenizer, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """The prompt of chat ``messages`` through the chat template; ``tools``: function tools in chat's
    form, which the template renders (None: no tools)."""
    rendered = [_message(m) for m in messages]
    try:
        text = render_chat(tokenizer, rendered, add_generation_prompt=add_generation_prompt, tools=tools)
    except Exception as exc:  # a template error is the messages' fault (e.g. roles out of order)
        raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
    ids = encode_text(tokenizer, text, "messages", add_special_tokens=False)
    if not ids:
        raise invalid_parameter("the rendered chat prompt is empty", "messages")
    return ids


def token_text(tokenizer: TextTokenizer, token_id: int) -> str:
    """One token's text (for logprobs), special tokens included."""
    return tokenizer.decode([token_id], skip_special_tokens=False)
