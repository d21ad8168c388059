"""tool_choice "required" or a named function as a `StructuredOutput` of kind tool_calls: the tools
a call may name (their schemas as canonical JSON), the tool format, whether calls may repeat, and
the think block before them. Plain data: the engine builds and compiles the grammar
(engine/grammars/tools.py, engine/structured_output/manager.py); api/ never imports the grammar engine."""

from __future__ import annotations

from typing import Any

from api.parsers.schema_types import (
    BOOL_TYPES,
    CONTAINER_PREFIXES,
    INT_PREFIXES,
    NUMBER_PREFIXES,
    param_type,
)
from engine.front import (
    THINK,
    Reasoning,
    StructuredOutput,
    ThinkTags,
    ToolSpec,
    XmlParam,
    XmlValueKind,
    canonical_json,
)

JSON_FORMAT = "qwen3"  # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
XML_FORMAT = "qwen3_coder"  # <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...


def tool_call_spec(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    tool_parser: str | None,
    reasoning: Reasoning = Reasoning.NONE,
    *,
    think: ThinkTags = THINK,
    parallel_tool_calls: bool = True,
) -> StructuredOutput | None:
    """What the output must be for `tool_choice`, or None when nothing is enforced ("auto",
    "none", no tools, or no tool parser to read calls with: the caller decides whether that is an
    error).

    `tools` and `tool_choice` as api/request/messages.py parsed them; `tool_parser`: "qwen3" or
    "qwen3_coder" (resolved). `reasoning`: whether a think block comes first (Reasoning.OPEN: the
    prompt left it open, so the output must close it first). "required" allows one call of any
    tool (one or more with `parallel_tool_calls`); a named function allows exactly one call of it.
    """
    if tool_parser is None or not tools or tool_choice in (None, "auto", "none"):
        return None
    if tool_parser not in (JSON_FORMAT, XML_FORMAT):
        raise ValueError(f"no grammar for tool format {tool_parser!r}")
    functions = [t["function"] for t in tools]
    parallel = parallel_tool_calls
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        functions = [f for f in functions if f["name"] == name]
        assert functions, f"tool_choice names {name!r}, which is not in tools (api/request/messages.py checks this)"
        parallel = False
    elif tool_choice != "required":
        raise ValueError(f"unknown tool_choice {tool_choice!r}")
    specs = tuple(_tool_spec(f, tool_parser == XML_FORMAT) for f in functions)
    return StructuredOutput.tool_calls(specs, tool_parser, parallel, reasoning, think)


def _tool_spec(function: dict[str, Any], xml: bool) -> ToolSpec:
    schema = function.get("parameters")
    parameters = canonical_json(schema) if schema else ""
    if not xml:
        return ToolSpec(function["name"], parameters)
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    return ToolSpec(function["name"], parameters, tuple(_xml_param(k, v) for k, v in properties.items()))


def _xml_param(name: str, schema: Any) -> XmlParam:
    """How the Qwen3-Coder parser reads this parameter's value back (api/parsers/schema_types.py
    decides the type, so the grammar and the parser always agree)."""
    ptype = param_type(schema)
    enum = schema.get("enum") if isinstance(schema, dict) else None
    kind: XmlValueKind
    if isinstance(enum, list) and enum:
        kind = "enum"
    elif ptype.is_string:
        kind = "text"
    elif ptype.name.startswith(INT_PREFIXES):
        kind = "integer"
    elif ptype.name.startswith(NUMBER_PREFIXES):
        kind = "number"
    elif ptype.name in BOOL_TYPES:
        kind = "boolean"
    elif ptype.name.startswith(CONTAINER_PREFIXES):
        kind = "array" if ptype.name.startswith(("array", "list")) else "object"
    elif ptype.name == "null":
        kind = "null"
    else:  # "any" and type names it does not know: the parser keeps text it cannot convert
        kind = "text"
    return XmlParam(name, kind, ptype.nullable)
