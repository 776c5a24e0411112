"""Tool calling: function tools and ``tool_choice``, the constraint a forced choice puts on the output,
and the parsers that find tool calls in a model's text (whole or streamed), per model family.

Independent of any request model: chat completions and the Responses API both use it.
:mod:`frontend.tools.spec` reads tools and choices and builds the constraint,
:mod:`frontend.tools.parsers` reads calls out of text (``--tool-call-parser``),
:mod:`frontend.tools.scan` is the incremental JSON call scanner under them.
"""

from __future__ import annotations

from frontend.tools.parsers import PARSERS, ToolParser, ToolStream, assemble, constrained_parser, get_parser
from frontend.tools.spec import (
    ToolChoice,
    ToolSpec,
    make_tool_call_id,
    parse_tool_choice,
    parse_tools,
    tool_choice_output,
)

__all__ = [
    "PARSERS",
    "ToolChoice",
    "ToolParser",
    "ToolSpec",
    "ToolStream",
    "assemble",
    "calls_from_constrained",
    "constrained_parser",
    "get_parser",
    "make_tool_call_id",
    "parse_tool_choice",
    "parse_tools",
    "tool_choice_output",
]


def calls_from_constrained(text: str, tools: list[ToolSpec], choice: ToolChoice) -> list[dict[str, object]]:
    """OpenAI ``tool_calls`` from what a forced ``choice`` made the model write."""
    return constrained_parser(tools, choice).extract(text)[1]
