"""Qwen3-Coder parameter values are raw text; this turns one into the JSON value the tool's
JSON schema asks for, with the rules vLLM and SGLang share (docs/anchors.md §2)."""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass

STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
NUMBER_PREFIXES = ("num", "float", "double")
BOOL_TYPES = frozenset({"boolean", "bool", "binary"})
CONTAINER_PREFIXES = ("object", "array", "dict", "list")
# Words that mean JSON null for non-string types, and for strings whose schema allows null.
NULL_WORDS = ("null", "None")


@dataclass(frozen=True)
class ParamType:
    """The one type a parameter's value converts to."""

    name: str  # lower-case JSON-schema type name; "string" when the schema names none
    nullable: bool = False

    @property
    def is_string(self) -> bool:
        return self.name in STRING_TYPES


STRING = ParamType("string")
ANY = ParamType("any")  # no usable type: literal_eval, else the raw string


def param_type(schema: object) -> ParamType:
    """The type of one `properties[p]` schema. A type list or `anyOf`/`oneOf` uses its first
    non-null member and notes that null is allowed; no type at all means string (as vLLM),
    except an `enum` of non-strings."""
    if not isinstance(schema, dict):
        return STRING
    nullable = schema.get("nullable") is True
    declared = schema.get("type")
    if isinstance(declared, list):
        names = [t.lower() for t in declared if isinstance(t, str)]
        nullable = nullable or "null" in names
        non_null = [t for t in names if t != "null"]
        if non_null:
            return ParamType(non_null[0], nullable)
        return ParamType("null", True) if names else STRING
    if isinstance(declared, str):
        return ParamType(declared.lower(), nullable or declared.lower() == "null")
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            types = [param_type(o) for o in options]
            nullable = nullable or any(t.nullable for t in types)
            non_null = [t for t in types if t.name != "null"]
            if non_null:
                return ParamType(non_null[0].name, nullable)
            return ParamType("null", True)
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and not all(isinstance(v, str) for v in enum):
        return ParamType(ANY.name, nullable or None in enum)
    return ParamType(STRING.name, nullable)


def convert_value(raw: str, ptype: ParamType) -> object:
    """The JSON value for a parameter's raw text (already stripped of its one leading and one
    trailing newline). Never raises: text that does not convert stays a string."""
    if ptype.is_string:
        return None if ptype.nullable and raw in NULL_WORDS else raw
    text = raw.strip()
    if text in NULL_WORDS:
        return None
    name = ptype.name
    if name.startswith(INT_PREFIXES):
        try:
            return int(text)
        except ValueError:
            return raw
    if name.startswith(NUMBER_PREFIXES):
        return _to_number(text, raw)
    if name in BOOL_TYPES:
        return text.lower() == "true"
    if name.startswith(CONTAINER_PREFIXES):
        try:
            return _jsonable(json.loads(text, strict=False, parse_constant=_reject_constant))
        except (ValueError, RecursionError):
            pass
    return _literal(text, raw)


def _to_number(text: str, raw: str) -> object:
    # Integral text stays an int (as SGLang: a float only when the text has '.' or 'e').
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        return raw
    # NOTE: float() accepts "nan"/"inf", which json.dumps would write as invalid JSON.
    return value if math.isfinite(value) else raw


def _literal(text: str, raw: str) -> object:
    try:
        return _jsonable(ast.literal_eval(text))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return raw


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _jsonable(value: object) -> object:
    """`value` as plain JSON data (tuples become lists); ValueError when it has no JSON form."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("non-finite float")
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError("non-string key")
        return {k: _jsonable(v) for k, v in value.items()}
    raise ValueError(f"{type(value).__name__} has no JSON form")
