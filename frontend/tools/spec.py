"""Function tools and ``tool_choice`` as requests give them, and the constraint a forced choice sets.

:func:`parse_tools` reads the ``tools`` list in either shape clients send:
chat completions' ``{"type": "function", "function": {name, description,
parameters, strict}}`` or the Responses API's flat ``{"type": "function",
name, description, parameters, strict}``; a tool that is not a function
with a valid name and an object schema is a 400 naming the parameter.
:func:`parse_tool_choice` reads ``"none"``, ``"auto"``, ``"required"`` or a
named function (both shapes). :func:`tool_choice_output` is the JSON schema
constraint vLLM puts on a forced choice: the named function's parameters, or
for ``required`` an array of ``{"name": <const>, "parameters": <schema>}``
objects (at least one; at most one without parallel tool calls). Pure: no
request model, no HTTP, so chat completions and the Responses API share it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from frontend.errors import invalid_parameter
from schemas import StructuredKind, StructuredOutput

__all__ = [
    "ToolChoice",
    "ToolSpec",
    "make_tool_call_id",
    "parse_tool_choice",
    "parse_tools",
    "tool_choice_output",
]

#: OpenAI's rule for function names
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def make_tool_call_id() -> str:
    """A tool call's id, as vLLM makes them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolSpec:
    """One function tool. ``parameters`` is its JSON schema (an empty object schema when none was given)."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(_EMPTY_PARAMETERS))
    strict: bool | None = None

    def chat_dict(self) -> dict[str, Any]:
        """The tool as chat completions carries it: what chat templates render (transformers passes this)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """``mode``: none, auto, required, or function (``name`` the function that must be called)."""

    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None

    @property
    def forced(self) -> bool:
        """Whether the output is constrained to tool calls (required or a named function)."""
        return self.mode in ("required", "function")


def parse_tools(raw: Any, param: str = "tools") -> list[ToolSpec]:
    """The function tools of a request's ``tools`` (None or an empty list: none); 400 naming ``param``
    for a bad one."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid_parameter(f"{param} must be a list of function tools", param)
    tools: list[ToolSpec] = []
    for index, item in enumerate(raw):
        where = f"{param}[{index}]"
        if not isinstance(item, Mapping) or item.get("type") != "function":
            raise invalid_parameter(
                f"{where} must be an object with type 'function' (only function tools are supported)", param
            )
        function = item.get("function", item)  # chat's nested form, or the Responses API's flat one
        if not isinstance(function, Mapping):
            raise invalid_parameter(f"{where}.function must be an object", param)
        tools.append(_tool(function, where, param))
    names = [tool.name for tool in tools]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        raise invalid_parameter(f"{param} names the function {duplicate!r} more than once", param)
    return tools


def _tool(function: Mapping[str, Any], where: str, param: str) -> ToolSpec:
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise invalid_parameter(
            f"{where}: a function name is 1 to 64 letters, digits, '_', '-', '.' or ':'", param
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid_parameter(f"{where}.description must be a string", param)
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(_EMPTY_PARAMETERS)
    if not isinstance(parameters, Mapping):
        raise invalid_parameter(f"{where}.parameters must be a JSON schema object", param)
    if parameters.get("type", "object") != "object":
        raise invalid_parameter(f"{where}.parameters must describe an object (type 'object')", param)
    try:
        json.dumps(parameters)
    except (TypeError, ValueError) as exc:  # pragma: no cover - a parsed JSON body always encodes
        raise invalid_parameter(f"{where}.parameters is not JSON: {exc}", param) from exc
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_parameter(f"{where}.strict must be a boolean", param)
    return ToolSpec(name=name, description=description, parameters=dict(parameters), strict=strict)


def parse_tool_choice(raw: Any, tools: Sequence[ToolSpec], param: str = "tool_choice") -> ToolChoice:
    """The request's ``tool_choice`` (None: ``auto`` with tools, ``none`` without, as OpenAI and vLLM;
    ``auto`` without tools is ``none``, as clients send it with no tools)."""
    if raw is None or raw == "auto":
        return ToolChoice("auto" if tools else "none")
    if raw in ("none", "required"):
        if raw == "required" and not tools:
            raise invalid_parameter(f"{param} 'required' needs tools", param)
        return ToolChoice(raw)
    if isinstance(raw, Mapping) and raw.get("type") == "function":
        function = raw.get("function", raw)
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            raise invalid_parameter(
                f'{param} names a function as {{"type": "function", "function": {{"name": "my_function"}}}}',
                param,
            )
        if all(tool.name != name for tool in tools):
            raise invalid_parameter(f"{param} names {name!r}, which is not among the tools", param)
        return ToolChoice("function", name)
    raise invalid_parameter(f"{param} must be 'none', 'auto', 'required' or a named function", param)


def tool_choice_output(
    tools: Sequence[ToolSpec], choice: ToolChoice, *, parallel_tool_calls: bool = True
) -> StructuredOutput | None:
    """The JSON schema a forced ``choice`` constrains the output to (None for auto and none), as vLLM's.

    A named function: its parameters' schema, the output is the arguments. ``required``: an array
    of calls, each ``{"name": <one of the tools>, "parameters": <its schema>}``, at least one and,
    with ``parallel_tool_calls`` false, at most one. Shared ``$defs`` of the tools' schemas are
    lifted to the array's root, where their ``#/$defs/...`` references point. The calls are
    written in JSON's usual spacing (``any_whitespace`` false).
    """
    if choice.mode == "function":
        tool = next(tool for tool in tools if tool.name == choice.name)
        return _json_schema(dict(tool.parameters))
    if choice.mode != "required":
        return None
    definitions: dict[str, Any] = {}
    variants = []
    for tool in tools:
        parameters = dict(tool.parameters)
        for name, definition in dict(parameters.pop("$defs", None) or {}).items():
            if name in definitions and definitions[name] != definition:
                raise invalid_parameter(
                    f"the tools define $defs {name!r} differently; a required tool choice "
                    "needs one definition per name",
                    "tools",
                )
            definitions[name] = definition
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [tool.name]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return _json_schema(schema)


def _json_schema(schema: Mapping[str, Any]) -> StructuredOutput:
    """Calls are written in JSON's usual form (``{"a": 1, "b": [2, 3]}``), not with any whitespace: the
    form models learn tool calls in, and an answer that ends once the call is complete."""
    return StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec=json.dumps(schema), any_whitespace=False)
