"""Our own EBNF rules for the structured outputs whose guarantees xgrammar's converters do not give
(engine/structured_output/manager.py says which and why): JSON values of a schema (schema.py) and forced tool
calls (tools.py); vLLM's `structural_tag` through xgrammar's own builder (structural_tag.py); a schema
with `pattern`, `format` or numeric ranges through xgrammar's converter,
with our bounds kept (xgrammar_json.py). `ebnf` is the one entry: a spec in, grammar text out."""

from __future__ import annotations

import json

from engine.grammars.schema import Rules, SchemaGrammar
from engine.grammars.structural_tag import structural_tag_ebnf
from engine.grammars.tools import tool_call_grammar
from engine.grammars.xgrammar_json import needs_xgrammar, xgrammar_value
from scheduler.structured_output import StructuredOutput


def ebnf(spec: StructuredOutput) -> str:
    """The grammar text of a json_object, json_schema, tool_calls or ebnf spec (regex has none:
    xgrammar compiles the pattern itself)."""
    if spec.kind == "ebnf":
        return spec.text
    if spec.kind == "structural_tag":
        return structural_tag_ebnf(spec.text)
    if spec.kind == "tool_calls":
        return tool_call_grammar(spec)
    rules = Rules()
    if spec.kind == "json_object":
        value = rules.base("json_object")
    elif spec.kind == "json_schema":
        schema = json.loads(spec.text)
        if needs_xgrammar(schema):
            value = xgrammar_value(rules, schema)
        else:
            value = SchemaGrammar(rules, schema).value(schema if isinstance(schema, dict) else {}, 0)
    else:
        raise ValueError(f"no EBNF for a {spec.kind} spec")
    return rules.with_reasoning(value, spec.reasoning, spec.think)
