"""EBNF grammars (xgrammar's dialect) for forced tool calls: the output is one or more tool calls in
the server's tool format, each naming an offered function with arguments that fit its JSON schema,
optionally after a think block. Built from a `StructuredOutput` of kind tool_calls (the api turned
tool_choice "required" or a named function into it); engine/structured_output/manager.py compiles the text."""

from __future__ import annotations

import json
from typing import Any

from engine.grammars.schema import Rules, SchemaGrammar, escape, literal, required_keys
from scheduler.structured_output import StructuredOutput, ToolSpec, XmlParam

JSON_FORMAT = "qwen3"  # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
XML_FORMAT = "qwen3_coder"  # <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...
# Where a Qwen3-Coder value ends for the parser (api/parsers/qwen3_coder_tool.py): a value must not
# contain any of them, or the parser would cut it there.
XML_VALUE_ENDS = ("</parameter>", "<parameter=", "</function>", "</tool_call>")


def tool_call_grammar(spec: StructuredOutput) -> str:
    """The grammar of `spec` (kind tool_calls): one call of any of its tools, or one or more with
    `parallel`, with the template's own newline between calls; a think block first as
    `spec.reasoning` says."""
    assert spec.kind == "tool_calls" and spec.tool_format in (JSON_FORMAT, XML_FORMAT), (
        f"{spec.kind} {spec.tool_format}"
    )
    rules = Rules()
    rules.base("blank")
    call_of = _json_call if spec.tool_format == JSON_FORMAT else _xml_call
    call = rules.add("call", " | ".join(call_of(rules, tool) for tool in spec.tools))
    calls = f"{call} ( blank {call} )*" if spec.parallel else call
    return rules.with_reasoning(calls, spec.reasoning, spec.think, blank_first=True)


def _json_call(rules: Rules, tool: ToolSpec) -> str:
    """`<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>`, as the chat template writes it:
    compact JSON, no whitespace but the separators' single spaces."""
    arguments = SchemaGrammar(rules, tool.schema).arguments()
    name = literal(json.dumps(tool.name, ensure_ascii=False))
    body = f'"<tool_call>\\n{{\\"name\\": " {name} ", \\"arguments\\": " {arguments} "}}\\n</tool_call>"'
    return rules.add(f"call_{tool.name}", body)


def _xml_call(rules: Rules, tool: ToolSpec) -> str:
    """`<tool_call>\n<function=NAME>\n` then each parameter in schema order (the required ones
    always) as `<parameter=P>\nVALUE\n</parameter>\n`, then `</function>\n</tool_call>`."""
    schema = tool.schema
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    required = required_keys(schema, properties)
    converter = SchemaGrammar(rules, schema)
    items = []
    for param in tool.xml_params:
        value = _xml_value(rules, converter, param, properties.get(param.name))
        item = f'"<parameter={escape(param.name)}>\\n" {value} "\\n</parameter>\\n"'
        items.append(item if param.name in required else f"( {item} )?")
    body = f'"<tool_call>\\n<function={escape(tool.name)}>\\n" {" ".join(items)} "</function>\\n</tool_call>"'
    return rules.add(f"call_{tool.name}", body)


def _xml_value(rules: Rules, converter: SchemaGrammar, param: XmlParam, schema: Any) -> str:
    """A Qwen3-Coder value: raw text for strings, JSON-typed text for the types the parser
    converts (`param.kind`, which the api took from the parser's own rules)."""
    kind = param.kind
    if kind == "enum":
        value = " | ".join(literal(_xml_enum_text(v)) for v in schema["enum"])
    elif kind == "text":
        return rules.text_without(XML_VALUE_ENDS, "xml_text")
    elif kind == "integer":
        value = rules.base("json_integer")
    elif kind == "number":
        value = rules.base("json_number")
    elif kind == "boolean":
        value = '"true" | "false"'
    elif kind in ("object", "array"):
        typed = isinstance(schema, dict) and schema.get("type") in ("object", "array")
        value = converter.value(schema, 1) if typed else rules.base(f"json_{kind}")
    else:  # null
        return '"null"'
    return f'( {value} | "null" )' if param.nullable else f"( {value} )"


def _xml_enum_text(value: Any) -> str:
    """An enum member as the text the parser turns back into it (strings raw, bools as Python
    literals, which `ast.literal_eval` reads; null as `null`)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return repr(value)
    return "null" if value is None else json.dumps(value, ensure_ascii=False)
