"""EBNF grammars (xgrammar's dialect) that make `tool_choice: "required"` or a named function
binding: the output is one or more tool calls in the server's tool format, each naming an offered
function with arguments that fit its JSON schema, optionally after a `<think>` block. Plain text:
api/ never imports the grammar engine; the engine compiles it (engine/structured.py)."""

from __future__ import annotations

import json
from typing import Any

from api.parsers.schema_types import BOOL_TYPES, CONTAINER_PREFIXES, INT_PREFIXES, NUMBER_PREFIXES, param_type
from api.schema_grammar import Rules, SchemaGrammar, escape, literal, required_keys

JSON_FORMAT = "qwen3"  # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
XML_FORMAT = "qwen3_coder"  # <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...
# Where a Qwen3-Coder value ends for the parser (api/parsers/qwen3_coder_tool.py): a value must not
# contain any of them, or the parser would cut it there.
XML_VALUE_ENDS = ("</parameter>", "<parameter=", "</function>", "</tool_call>")


def tool_call_grammar(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    tool_parser: str | None,
    reasoning: bool,
    *,
    starts_in_reasoning: bool = False,
    parallel_tool_calls: bool = True,
) -> str | None:
    """The grammar the output must match for `tool_choice`, or None when nothing is enforced
    ("auto", "none", no tools, or no tool parser to read calls with: the caller decides whether
    that is an error).

    `tools` and `tool_choice` as api/messages.py parsed them; `tool_parser`: "qwen3" or
    "qwen3_coder" (resolved). `reasoning`: the output may open with a `<think>...</think>` block
    (a reasoning parser is on and the prompt did not close the block). `starts_in_reasoning`: the
    prompt left `<think>` open, so the output starts inside the block and must close it first.
    "required" allows one call of any tool (one or more with `parallel_tool_calls`); a named
    function allows exactly one call of it.
    """
    if tool_parser is None or not tools or tool_choice in (None, "auto", "none"):
        return None
    if tool_parser not in (JSON_FORMAT, XML_FORMAT):
        raise ValueError(f"no grammar for tool format {tool_parser!r}")
    functions = [t["function"] for t in tools]
    many = parallel_tool_calls
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        functions = [f for f in functions if f["name"] == name]
        assert functions, f"tool_choice names {name!r}, which is not in tools (api/messages.py checks this)"
        many = False
    elif tool_choice != "required":
        raise ValueError(f"unknown tool_choice {tool_choice!r}")
    rules = Rules()
    rules.base("blank")
    call_of = _json_call if tool_parser == JSON_FORMAT else _xml_call
    call = rules.add("call", " | ".join(call_of(rules, f) for f in functions))
    calls = f"{call} ( blank {call} )*" if many else call
    return rules.with_reasoning(calls, reasoning, starts_in_reasoning, blank_first=True)


def _json_call(rules: Rules, function: dict[str, Any]) -> str:
    """`<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>`, as the chat template writes it:
    compact JSON, no whitespace but the separators' single spaces."""
    arguments = SchemaGrammar(rules, function.get("parameters")).arguments()
    name = literal(json.dumps(function["name"], ensure_ascii=False))
    body = f'"<tool_call>\\n{{\\"name\\": " {name} ", \\"arguments\\": " {arguments} "}}\\n</tool_call>"'
    return rules.add(f"call_{function['name']}", body)


def _xml_call(rules: Rules, function: dict[str, Any]) -> str:
    """`<tool_call>\n<function=NAME>\n` then each parameter in schema order (the required ones
    always) as `<parameter=P>\nVALUE\n</parameter>\n`, then `</function>\n</tool_call>`."""
    schema = function.get("parameters")
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    required = required_keys(schema, properties)
    converter = SchemaGrammar(rules, schema)
    items = []
    for key, sub in properties.items():
        item = f'"<parameter={escape(key)}>\\n" {_xml_value(rules, converter, sub)} "\\n</parameter>\\n"'
        items.append(item if key in required else f"( {item} )?")
    body = f'"<tool_call>\\n<function={escape(function["name"])}>\\n" {" ".join(items)} "</function>\\n</tool_call>"'
    return rules.add(f"call_{function['name']}", body)


def _xml_value(rules: Rules, converter: SchemaGrammar, schema: Any) -> str:
    """A Qwen3-Coder value: raw text for strings, JSON-typed text for the types the parser
    converts (api/parsers/schema_types.py decides the type, so the two always agree)."""
    ptype = param_type(schema)
    enum = schema.get("enum") if isinstance(schema, dict) else None
    name = ptype.name
    if isinstance(enum, list) and enum:
        value = " | ".join(literal(_xml_enum_text(v)) for v in enum)
    elif ptype.is_string:
        return rules.text_without(XML_VALUE_ENDS, "xml_text")
    elif name.startswith(INT_PREFIXES):
        value = rules.base("json_integer")
    elif name.startswith(NUMBER_PREFIXES):
        value = rules.base("json_number")
    elif name in BOOL_TYPES:
        value = '"true" | "false"'
    elif name.startswith(CONTAINER_PREFIXES):
        typed = isinstance(schema, dict) and schema.get("type") in ("object", "array")
        value = converter.value(schema, 1) if typed else rules.base("json_array" if name.startswith(("array", "list")) else "json_object")
    elif name == "null":
        return '"null"'
    else:  # "any" and type names it does not know: the parser keeps text it cannot convert
        return rules.text_without(XML_VALUE_ENDS, "xml_text")
    return f'( {value} | "null" )' if ptype.nullable else f"( {value} )"


def _xml_enum_text(value: Any) -> str:
    """An enum member as the text the parser turns back into it (strings raw, bools as Python
    literals, which `ast.literal_eval` reads; null as `null`)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return repr(value)
    return "null" if value is None else json.dumps(value, ensure_ascii=False)
