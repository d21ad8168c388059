"""Qwen3-Coder value conversion: the schema's type picks the conversion, anything that does
not convert stays the raw string, and the result is always JSON-serializable."""

from __future__ import annotations

import json

import pytest

from api.parsers.schema_types import ParamType, convert_value, param_type


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ({"type": "string"}, ParamType("string")),
        ({"type": "Integer"}, ParamType("integer")),
        ({"type": ["integer", "null"]}, ParamType("integer", nullable=True)),
        ({"type": ["null", "number"]}, ParamType("number", nullable=True)),
        ({"anyOf": [{"type": "null"}, {"type": "array"}]}, ParamType("array", nullable=True)),
        ({"oneOf": [{"type": "boolean"}, {"type": "string"}]}, ParamType("boolean")),
        ({"type": "string", "nullable": True}, ParamType("string", nullable=True)),
        ({"type": "null"}, ParamType("null", nullable=True)),
        ({"enum": ["a", "b"]}, ParamType("string")),
        ({"enum": [1, 2, None]}, ParamType("any", nullable=True)),
        ({}, ParamType("string")),
        ("not a schema", ParamType("string")),
    ],
)
def test_param_type_reads_first_non_null_type(schema: object, expected: ParamType) -> None:
    assert param_type(schema) == expected


@pytest.mark.parametrize(
    ("type_name", "raw", "expected"),
    [
        ("string", "null", "null"),
        ("string", " 42 ", " 42 "),
        ("integer", "42", 42),
        ("integer", " -7 ", -7),
        ("int64", "12345678901234567890", 12345678901234567890),
        ("integer", "4.5", "4.5"),
        ("integer", "many", "many"),
        ("number", "3", 3),
        ("number", "2.50", 2.5),
        ("float", "1e3", 1000.0),
        ("number", "nan", "nan"),
        ("number", "inf", "inf"),
        ("boolean", "True", True),
        ("boolean", "false", False),
        ("bool", "yes", False),
        ("object", '{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}),
        ("object", "{'a': (1, 2)}", {"a": [1, 2]}),
        ("object", '{"a": NaN}', '{"a": NaN}'),
        ("array", "[1, 'two', 3.0]", [1, "two", 3.0]),
        ("array", "{1, 2}", "{1, 2}"),
        ("array", "[unclosed", "[unclosed"),
        ("dict", '{"x": "line\nbreak"}', {"x": "line\nbreak"}),
        ("integer", "null", None),
        ("array", "None", None),
        ("any", "(1, 'a')", [1, "a"]),
        ("any", "1+2j", "1+2j"),
        ("any", "hello", "hello"),
    ],
)
def test_convert_value_follows_the_schema_type(type_name: str, raw: str, expected: object) -> None:
    value = convert_value(raw, ParamType(type_name))
    assert value == expected and type(value) is type(expected)
    json.dumps(value, allow_nan=False)


@pytest.mark.parametrize(("raw", "expected"), [("null", None), ("None", None), ("nul", "nul"), ("NULL", "NULL")])
def test_nullable_string_accepts_null_words_only(raw: str, expected: object) -> None:
    assert convert_value(raw, ParamType("string", nullable=True)) == expected


def test_deeply_nested_literal_stays_a_string_instead_of_raising() -> None:
    raw = "[" * 100_000 + "]" * 100_000
    assert convert_value(raw, ParamType("array")) == raw
