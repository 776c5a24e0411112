"""Responses API items: the request's ``input`` checked and normalized, items turned into chat
messages, and the output items of an answer. Pure.

An ``input`` is a string (one user message) or a list of items:

* messages: ``{"role": "user" | "assistant" | "system" | "developer", "content": ...}`` (``type``
  ``"message"`` optional), the content a string or parts of type ``input_text`` / ``output_text``
  (``refusal`` parts count as text); images, files and audio are a 400;
* ``function_call`` (``call_id``, ``name``, ``arguments``): a call the model made, as a previous
  response's output holds it;
* ``function_call_output`` (``call_id``, ``output``): the result the client sends back.

Any other item type (``reasoning``, ``item_reference``, built-in tool calls) is a 400 naming its
place (``input[2]``). :func:`normalize_input` gives every item OpenAI's full shape (with an ``id``),
the form the store keeps. :func:`chat_messages` is what the chat template renders: ``instructions``
as the system message, consecutive function calls as one assistant message with ``tool_calls``
(OpenAI's chat shape), each output as a ``tool`` message with its ``tool_call_id``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from frontend.errors import invalid_parameter

__all__ = [
    "Item",
    "chat_messages",
    "function_call_item",
    "item_text",
    "message_item",
    "new_id",
    "normalize_input",
]

#: one item, in OpenAI's JSON shape
Item = dict[str, Any]

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    """A fresh id in OpenAI's style: ``resp_...``, ``msg_...``, ``fc_...``, ``call_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(role: str, text: str, *, item_id: str | None = None, status: str = "completed") -> Item:
    """A message item; an assistant's text is ``output_text``, anyone else's ``input_text``."""
    part: Item = {"type": "input_text", "text": text}
    if role == "assistant":
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "id": item_id or new_id("msg"),
        "type": "message",
        "role": role,
        "status": status,
        "content": [part],
    }


def function_call_item(
    name: str, arguments: str, call_id: str, *, item_id: str | None = None, status: str = "completed"
) -> Item:
    return {
        "id": item_id or new_id("fc"),
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def normalize_input(raw: str | Sequence[Mapping[str, Any]]) -> list[Item]:
    """The request's ``input`` as items of OpenAI's full shape; a 400 naming the first bad one."""
    if isinstance(raw, str):
        return [message_item("user", raw)]
    return [_item(item, f"input[{index}]") for index, item in enumerate(raw)]


def _string(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid_parameter(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def _item(item: Mapping[str, Any], where: str) -> Item:
    kind = item.get("type", "message" if "role" in item else None)
    item_id = item.get("id") if isinstance(item.get("id"), str) else None
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise invalid_parameter(f"{where}.role must be one of {', '.join(_ROLES)}", f"{where}.role")
        return message_item(str(role), _content_text(item.get("content"), where), item_id=item_id)
    if kind == "function_call":
        return function_call_item(
            _string(item, "name", where),
            _string(item, "arguments", where),
            _string(item, "call_id", where),
            item_id=item_id,
        )
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _content_text(output, f"{where}.output")
        return {
            "id": item_id or new_id("fco"),
            "type": "function_call_output",
            "status": "completed",
            "call_id": _string(item, "call_id", where),
            "output": text,
        }
    raise invalid_parameter(
        f"{where}: items of type {kind!r} are not supported (messages, function_call and "
        "function_call_output are)",
        where,
    )


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_parameter(f"{where}.content must be a string or a list of parts", f"{where}.content")
    texts: list[str] = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        text = part.get("refusal" if kind == "refusal" else "text") if isinstance(part, Mapping) else None
        if kind not in (*_TEXT_PARTS, "refusal") or not isinstance(text, str):
            raise invalid_parameter(
                f"{where}.content[{index}]: content of type {kind!r} is not supported (text only)",
                f"{where}.content",
            )
        texts.append(text)
    return "".join(texts)


def item_text(item: Mapping[str, Any]) -> str:
    """A message item's text (its parts joined)."""
    return "".join(
        str(part.get("refusal" if part.get("type") == "refusal" else "text") or "")
        for part in item["content"]
    )


def chat_messages(items: Sequence[Mapping[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages the template renders for ``items`` (normalized), after ``instructions``."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    names: dict[str, str] = {}
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": item_text(item)})
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            message = {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            if item["call_id"] in names:
                message["name"] = names[item["call_id"]]
            messages.append(message)
    return messages
