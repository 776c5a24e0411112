"""Structured-output requests: the OpenAI and vLLM fields that constrain the output, checked and
turned into the wire's :class:`~schemas.StructuredOutput`.

A request constrains its output with one of:

* ``response_format`` (OpenAI): ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (any JSON object) or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
* ``structured_outputs`` (vLLM's extension): one of ``json`` (a schema, as an object or JSON
  text), ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark, or GBNF ``root ::= ...``)
  or ``json_object: true``, with ``disable_any_whitespace`` and ``disable_additional_properties``;
* the older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields,
  which vLLM still accepts.

More than one of them at once is a 400. Every constraint is checked here with the grammar library
shoal's engines enforce it with (llguidance), by the engines' own translation
(:func:`agents.engines.grammar.grammar_problem`), so a constraint the frontend lets through is one
they can build: a bad schema, regex or grammar is a 400 naming the field and llguidance's reason,
never a failure after dispatch. The check's outcome is cached per constraint.

``strict`` (OpenAI's) is accepted and changes nothing, as in vLLM: the schema is always enforced
in full, and a schema with a keyword the grammar cannot enforce is a 400 whatever ``strict`` says.
The pydantic models of these fields live here (:class:`ResponseFormat`,
:class:`StructuredOutputsOptions`); the request models in :mod:`frontend.openai_models` declare
them. Tool calls (:mod:`frontend.tools`) and the Responses API's ``text.format`` build their
constraints with :func:`json_schema_output`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from agents.engines.grammar import grammar_problem
from frontend.errors import invalid_parameter
from schemas import StructuredKind, StructuredOutput

__all__ = [
    "JsonSchemaFormat",
    "ResponseFormat",
    "StructuredFields",
    "StructuredOutputsOptions",
    "constraint_fields",
    "json_schema_output",
    "structured_of",
    "validate_structured",
]

#: a constraint longer than this (its spec's characters) is refused before it is compiled
MAX_SPEC_CHARS = 200_000


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema and its name (OpenAI's)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: text (no constraint), any JSON object, or JSON that follows a schema."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsOptions(BaseModel):
    """``structured_outputs`` (vLLM's extension): exactly one of ``json``, ``regex``, ``choice``,
    ``grammar`` and ``json_object``."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    #: JSON kinds: the compact form only (no whitespace between tokens)
    disable_any_whitespace: bool | None = False
    #: JSON schema: objects that do not say otherwise get ``additionalProperties: false``
    disable_additional_properties: bool | None = False
    #: accepted and ignored: the engine's grammar library is its own choice
    disable_fallback: bool | None = False
    #: not supported (a 400 when set)
    whitespace_pattern: str | None = None
    structural_tag: str | dict[str, Any] | None = None


class StructuredFields(Protocol):
    """What :func:`structured_of` reads of a request."""

    response_format: ResponseFormat | None
    structured_outputs: StructuredOutputsOptions | None
    guided_json: dict[str, Any] | bool | str | None
    guided_regex: str | None
    guided_choice: list[str] | None
    guided_grammar: str | None
    guided_whitespace_pattern: str | None


@functools.lru_cache(maxsize=1024)
def _problem(output: StructuredOutput) -> str | None:
    """Why the engines cannot build ``output`` (None if they can); cached per constraint."""
    return grammar_problem(output)


def validate_structured(
    output: StructuredOutput, param: str, *, label: str | None = None
) -> StructuredOutput:
    """``output`` if the engines' grammar library can build it; else a 400 naming ``param`` (and
    ``label`` in the message, ``param`` if not given)."""
    if len(output.spec) > MAX_SPEC_CHARS:
        raise invalid_parameter(f"{param} is longer than {MAX_SPEC_CHARS} characters", param)
    problem = _problem(output)
    if problem:
        raise invalid_parameter(f"{label or param}: {problem}", param)
    return output


def json_schema_output(
    schema: Mapping[str, Any] | bool | str,
    *,
    strict: bool | None = None,
    param: str,
    any_whitespace: bool = True,
    no_additional_properties: bool = False,
    name: str | None = None,
) -> StructuredOutput:
    """The constraint "JSON that validates against ``schema``" (a mapping, a boolean schema or
    JSON text); a 400 naming ``param`` if the schema is not one the grammar can enforce.

    ``strict`` is OpenAI's flag, accepted as vLLM does: the schema is enforced in full either way.
    ``no_additional_properties``: an object schema that does not set ``additionalProperties``
    allows no other properties (vLLM's ``disable_additional_properties``). ``name``: the schema's
    name, quoted in the error as OpenAI does."""
    del strict  # see the docstring: enforcement does not depend on it
    label = f"{param} '{name}'" if name else param
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise invalid_parameter(f"Invalid schema for {label}: not JSON ({exc})", param) from exc
    if not isinstance(schema, (Mapping, bool)):
        raise invalid_parameter(f"Invalid schema for {label}: a JSON schema is an object or a boolean", param)
    if schema is False:
        raise invalid_parameter(f"Invalid schema for {label}: the schema false accepts nothing", param)
    if schema is True:
        schema = {}  # any JSON value
    if no_additional_properties:
        schema = _closed_objects(schema)
    spec = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    return validate_structured(
        StructuredOutput(kind=StructuredKind.JSON_SCHEMA, spec=spec, any_whitespace=any_whitespace),
        param,
        label=label,
    )


def _closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not set it."""
    if isinstance(schema, list):
        return [_closed_objects(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    closed = {key: _closed_objects(value) for key, value in schema.items()}
    if (closed.get("type") == "object" or "properties" in closed) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def constraint_fields(request: StructuredFields) -> list[str]:
    """The names of the fields of ``request`` that constrain its output (response_format other
    than text, structured_outputs, guided_*)."""
    names = []
    if request.response_format is not None and request.response_format.type != "text":
        names.append("response_format")
    if request.structured_outputs is not None:
        names.append("structured_outputs")
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(request, name) is not None:
            names.append(name)
    return names


def structured_of(request: StructuredFields) -> StructuredOutput | None:
    """The request's output constraint, checked; None for free text. A 400 naming the field for a
    bad one, for more than one at once, and for vLLM's options shoal does not implement
    (``whitespace_pattern``, ``structural_tag``)."""
    fields = constraint_fields(request)
    if len(fields) > 1:
        raise invalid_parameter(
            f"at most one of response_format, structured_outputs and guided_* may constrain the output; "
            f"this request sets {', '.join(fields)}",
            fields[1],
        )
    if request.guided_whitespace_pattern is not None:
        raise invalid_parameter("guided_whitespace_pattern is not supported", "guided_whitespace_pattern")
    if not fields:
        return None
    field = fields[0]
    if field == "response_format":
        assert request.response_format is not None
        return _of_response_format(request.response_format)
    if field == "structured_outputs":
        assert request.structured_outputs is not None
        return _of_structured_outputs(request.structured_outputs)
    if field == "guided_json":
        assert request.guided_json is not None
        return json_schema_output(request.guided_json, param=field)
    if field == "guided_regex":
        return _checked(StructuredKind.REGEX, request.guided_regex or "", field)
    if field == "guided_choice":
        return _choice(request.guided_choice or [], field)
    return _checked(StructuredKind.GRAMMAR, request.guided_grammar or "", field)


def _of_response_format(response_format: ResponseFormat) -> StructuredOutput:
    if response_format.type == "json_object":
        return StructuredOutput(kind=StructuredKind.JSON_OBJECT)
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise invalid_parameter(
            "response_format of type json_schema needs json_schema.schema", "response_format"
        )
    return json_schema_output(spec.schema_, strict=spec.strict, param="response_format", name=spec.name)


def _of_structured_outputs(options: StructuredOutputsOptions) -> StructuredOutput:
    if options.whitespace_pattern is not None:
        raise invalid_parameter(
            "structured_outputs.whitespace_pattern is not supported", "structured_outputs.whitespace_pattern"
        )
    if options.structural_tag is not None:
        raise invalid_parameter(
            "structured_outputs.structural_tag is not supported", "structured_outputs.structural_tag"
        )
    given = [
        name
        for name, value in (
            ("json", options.json_),
            ("regex", options.regex),
            ("choice", options.choice),
            ("grammar", options.grammar),
            ("json_object", options.json_object or None),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise invalid_parameter(
            "structured_outputs needs exactly one of json, regex, choice, grammar and json_object"
            + (f"; it sets {', '.join(given)}" if given else ""),
            "structured_outputs",
        )
    kind, param = given[0], f"structured_outputs.{given[0]}"
    any_whitespace = not options.disable_any_whitespace
    if kind == "json":
        assert options.json_ is not None
        return json_schema_output(
            options.json_,
            param=param,
            any_whitespace=any_whitespace,
            no_additional_properties=bool(options.disable_additional_properties),
        )
    if kind == "json_object":
        return StructuredOutput(kind=StructuredKind.JSON_OBJECT, any_whitespace=any_whitespace)
    if kind == "regex":
        return _checked(StructuredKind.REGEX, options.regex or "", param)
    if kind == "choice":
        return _choice(options.choice or [], param)
    return _checked(StructuredKind.GRAMMAR, options.grammar or "", param)


def _checked(kind: StructuredKind, spec: str, param: str) -> StructuredOutput:
    if not spec:
        raise invalid_parameter(f"{param} is empty", param)
    return validate_structured(StructuredOutput(kind=kind, spec=spec), param)


def _choice(choices: list[str], param: str) -> StructuredOutput:
    if not choices:
        raise invalid_parameter(f"{param} needs at least one choice", param)
    if any(not choice for choice in choices):
        raise invalid_parameter(f"{param} has an empty choice", param)
    return _checked(StructuredKind.CHOICE, json.dumps(choices, ensure_ascii=False), param)
