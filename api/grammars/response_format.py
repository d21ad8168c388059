"""`response_format` of chat and completions: the request field parsed into a frozen
`ResponseFormat` (its JSON schema checked: a bad one is a 400 here, before any compile), and the
`StructuredOutput` the engine then enforces, after an optional think block.

A json_schema is enforced as engine/grammars/schema.py's `SchemaGrammar` reads it: types, properties
and required (in the schema's order, undeclared ones refused, with or without `strict`), items,
min/maxItems, enum, const, anyOf/oneOf, allOf of one, local $refs, nullable, min/maxLength up to
32. A schema that uses pattern, format, minimum/maximum or exclusiveMinimum/exclusiveMaximum anywhere
goes through xgrammar's converter instead (engine/grammars/xgrammar_json.py), which enforces them,
with the same compact separators and bounded numbers. Not enforced (the output may break them):
multipleOf, uniqueItems, prefixItems, contains, patternProperties, propertyNames,
min/maxProperties, not, if/then/else, allOf of several, oneOf's exclusivity."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from api.errors import bad_request
from engine.front import THINK, Reasoning, StructuredOutput, ThinkTags

JSON_OBJECT, JSON_SCHEMA = "json_object", "json_schema"
KINDS = ("text", JSON_OBJECT, JSON_SCHEMA)
PARAM = "response_format"
# Past this nesting the checker stops (a 400), long before Python's recursion limit would.
MAX_CHECK_DEPTH = 64
JSON_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
# Keywords whose value is one schema, a list of schemas, or a map of name -> schema.
_ONE_SCHEMA = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_BOUNDS = (("minItems", "maxItems"), ("minLength", "maxLength"), ("minProperties", "maxProperties"))
_LOCAL_REF = re.compile(r"#/(\$defs|definitions)/([^/]+)")


@dataclass(frozen=True)
class ResponseFormat:
    """A format the output must have ("text" is no format: parse_response_format returns None).
    regex, grammar and choice come from vLLM's fields (api/grammars/vllm_fields.py)."""

    type: Literal["json_object", "json_schema", "regex", "grammar", "choice", "structural_tag"]
    schema: dict[str, Any] | bool | None = None  # json_schema only; checked by check_schema
    name: str | None = None
    strict: bool | None = None  # accepted; the grammar enforces the schema either way
    text: str | None = None  # regex: the pattern; grammar: its EBNF; choice: the EBNF of its literals;
    # structural_tag: its JSON text

    def __post_init__(self) -> None:
        assert (self.type == JSON_SCHEMA) == (self.schema is not None), f"{self.type} with schema {self.schema!r}"
        assert (self.type in ("regex", "grammar", "choice", "structural_tag")) == bool(self.text), (
            f"{self.type} with text {self.text!r}"
        )


class SchemaError(Exception):
    """A JSON schema this server cannot follow; `where` is a JSON pointer into it."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"at {where}: {message}")
        self.where = where


def parse_response_format(raw: Any) -> ResponseFormat | None:
    """The request's `response_format`, None for absent or {"type": "text"}; APIError (400,
    naming response_format) for anything malformed."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad_request('response_format must be an object such as {"type": "json_object"}', PARAM)
    kind = raw.get("type")
    if kind not in KINDS:
        raise bad_request(f"response_format.type must be one of {', '.join(KINDS)}; got {kind!r}", f"{PARAM}.type")
    if kind == "text":
        return None
    if kind == JSON_OBJECT:
        return ResponseFormat(JSON_OBJECT)
    spec = raw.get("json_schema")
    if not isinstance(spec, dict):
        message = "response_format json_schema needs a json_schema object with a name and a schema"
        raise bad_request(message, f"{PARAM}.json_schema")
    name, schema, strict = spec.get("name"), spec.get("schema"), spec.get("strict")
    if not isinstance(name, str) or not name:
        raise bad_request("response_format.json_schema.name must be a non-empty string", f"{PARAM}.json_schema.name")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("response_format.json_schema.strict must be a boolean", f"{PARAM}.json_schema.strict")
    if schema is None:
        raise bad_request("response_format.json_schema.schema is required", f"{PARAM}.json_schema.schema")
    try:
        check_schema(schema)
    except SchemaError as e:
        # OpenAI's wording and param for the same mistake.
        raise bad_request(f"invalid schema for response_format {name!r}: {e}", PARAM) from None
    return ResponseFormat(JSON_SCHEMA, schema, name, strict)


def refuse_with_tool_choice(fmt: ResponseFormat | None, tool_choice: str | dict[str, Any] | None) -> None:
    """Two grammars cannot both bind one output: a forced tool call or a format, not both."""
    if fmt is not None and tool_choice is not None and tool_choice not in ("auto", "none"):
        forced = "'required'" if tool_choice == "required" else "a named function"
        raise bad_request(f"response_format {fmt.type} cannot be combined with tool_choice {forced}; pick one", PARAM)


def response_format_spec(
    fmt: ResponseFormat, reasoning: Reasoning = Reasoning.NONE, think: ThinkTags = THINK
) -> StructuredOutput:
    """What an output in `fmt` must be: one JSON object (json_object) or one value that fits the
    schema, with no text before or after it; a think block first as `reasoning` says. A regex or
    a grammar binds the whole output: no think block before it."""
    if fmt.type == "regex":
        assert fmt.text is not None
        return StructuredOutput.regex(fmt.text)
    if fmt.type in ("grammar", "choice"):
        assert fmt.text is not None
        return StructuredOutput.ebnf(fmt.text)
    if fmt.type == "structural_tag":
        assert fmt.text is not None
        return StructuredOutput.structural_tag(fmt.text)
    if fmt.type == JSON_OBJECT:
        return StructuredOutput.json_object(reasoning, think)
    return StructuredOutput.json_schema(fmt.schema, reasoning, think)


def check_schema(schema: Any) -> None:
    """Raise SchemaError where `schema` is not a JSON schema the grammar can follow: a node that
    is not an object or boolean, an unknown type, a malformed keyword, bounds the wrong way
    round, a required name that is not a declared property, or a $ref that is not local. Unknown
    keywords pass (and are not enforced)."""
    if schema is False:
        raise SchemaError("#", "the schema false allows no value at all")
    _check(schema, "#", schema, 0)


def _check(node: Any, where: str, root: Any, depth: int) -> None:
    if isinstance(node, bool):
        return  # true: anything; false: nothing (the grammar takes it as anything too)
    if not isinstance(node, dict):
        raise SchemaError(where, "a schema must be an object")
    if depth > MAX_CHECK_DEPTH:
        raise SchemaError(where, f"the schema is nested deeper than {MAX_CHECK_DEPTH} levels")
    _check_type(node.get("type"), where)
    enum = node.get("enum")
    if enum is not None and (not isinstance(enum, list) or not enum):
        raise SchemaError(f"{where}/enum", "enum must be a non-empty array")
    properties = node.get("properties")
    required = node.get("required")
    if required is not None:
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{where}/required", "required must be an array of property names")
        missing = [r for r in required if isinstance(properties, dict) and r not in properties]
        if missing:
            raise SchemaError(f"{where}/required", f"{missing[0]!r} is required but not in properties")
    for low, high in _BOUNDS:
        lo, hi = _bound(node, low, where), _bound(node, high, where)
        if lo is not None and hi is not None and lo > hi:
            raise SchemaError(where, f"{low} ({lo}) is more than {high} ({hi})")
    if "$ref" in node:
        _check_ref(node["$ref"], f"{where}/$ref", root)
    for key in _ONE_SCHEMA:
        if key in node:
            _check(node[key], f"{where}/{key}", root, depth + 1)
    for key in _SCHEMA_LISTS:
        if key in node:
            options = node[key]
            if not isinstance(options, list) or not options:
                raise SchemaError(f"{where}/{key}", f"{key} must be a non-empty array of schemas")
            for i, option in enumerate(options):
                _check(option, f"{where}/{key}/{i}", root, depth + 1)
    for key in _SCHEMA_MAPS:
        if key in node:
            named = node[key]
            if not isinstance(named, dict):
                raise SchemaError(f"{where}/{key}", f"{key} must be an object of schemas")
            for name, sub in named.items():
                _check(sub, f"{where}/{key}/{_pointer_token(name)}", root, depth + 1)


def _check_type(kind: Any, where: str) -> None:
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if isinstance(kind, list) and not kind:
        raise SchemaError(f"{where}/type", "type must not be an empty array")
    for k in kinds:
        if k not in JSON_TYPES:
            raise SchemaError(f"{where}/type", f"unknown type {k!r}; types are {', '.join(sorted(JSON_TYPES))}")


def _bound(node: dict[str, Any], key: str, where: str) -> int | None:
    value = node.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SchemaError(f"{where}/{key}", f"{key} must be a non-negative integer")
    return value


def _check_ref(ref: Any, where: str, root: Any) -> None:
    """Only references into the schema itself: the server fetches nothing."""
    if not isinstance(ref, str):
        raise SchemaError(where, "$ref must be a string")
    if ref == "#":
        return
    match = _LOCAL_REF.fullmatch(ref)
    if match is None:
        raise SchemaError(where, f"$ref {ref!r} is not supported; use '#', '#/$defs/NAME' or '#/definitions/NAME'")
    defs = root.get(match.group(1)) if isinstance(root, dict) else None
    if not isinstance(defs, dict) or match.group(2) not in defs:
        raise SchemaError(where, f"$ref {ref!r} names no schema in {match.group(1)}")


def _pointer_token(name: str) -> str:
    """A property name as a JSON pointer step (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")
