"""The tool_choice grammars (api/grammars/tool_grammar.py's spec, engine/grammars/) checked by xgrammar's own
matcher: they accept the tool-call texts Qwen3 / Qwen3-Coder write (the chat template's own
rendering included) and the parsers read those back to the same calls; they refuse wrong names,
missing or undeclared arguments, wrong types, stray text, and a second call when only one is
allowed, and any whitespace but json.dumps' separators. Schema keywords are covered one by one."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import xgrammar as xgr
from hypothesis import given, settings
from hypothesis import strategies as st

from api.grammars.tool_grammar import tool_call_spec
from api.parsers import parse_text
from engine.grammars import ebnf
from engine.grammars.schema import Rules, SchemaGrammar
from scheduler.structured_output import Reasoning

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "metric": {"type": "boolean"},
                "hours": {"type": "array", "items": {"type": "integer"}},
                "note": {"type": ["string", "null"]},
            },
            "required": ["city", "days"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters
TOOLS = [WEATHER, NOW]
NAMED_NOW = {"type": "function", "function": {"name": "now"}}

Accepts = Callable[[str, str], bool]


@pytest.fixture(scope="module")
def accepts() -> Accepts:
    """Whether a grammar matches a whole text: xgrammar's matcher, character by character."""
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1, cache_enabled=False)
    compiled: dict[str, Any] = {}

    def check(grammar: str, text: str) -> bool:
        if grammar not in compiled:
            compiled[grammar] = compiler.compile_grammar(grammar)
        matcher = xgr.GrammarMatcher(compiled[grammar])
        return matcher.accept_string(text) and matcher.is_completed()

    return check


def json_call(name: str, arguments: Any, separators: tuple[str, str] = (", ", ": ")) -> str:
    args = json.dumps(arguments, ensure_ascii=False, separators=separators)
    return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n</tool_call>'


def xml_call(name: str, values: dict[str, str]) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def tool_call_grammar(
    tools: Any,
    tool_choice: Any,
    tool_parser: str | None,
    reasoning: bool,
    *,
    starts_in_reasoning: bool = False,
    parallel_tool_calls: bool = True,
) -> str | None:
    """The api's spec for tool_choice, as the engine's grammar text (None: nothing enforced)."""
    mode = Reasoning.OPEN if starts_in_reasoning else Reasoning.OPTIONAL if reasoning else Reasoning.NONE
    spec = tool_call_spec(tools, tool_choice, tool_parser, mode, parallel_tool_calls=parallel_tool_calls)
    return None if spec is None else ebnf(spec)


def grammar(fmt: str, tool_choice: Any = "required", reasoning: bool = False, **kwargs: Any) -> str:
    g = tool_call_grammar(TOOLS, tool_choice, fmt, reasoning, **kwargs)
    assert g is not None
    return g


def parsed_calls(fmt: str, text: str, reasoning: bool = False) -> list[tuple[str, Any]]:
    out = parse_text(text, fmt, "qwen3" if reasoning else None, TOOLS, starts_in_reasoning=False)
    return [(c.name, json.loads(c.arguments_json)) for c in out.tool_calls]


# ---- what is enforced at all -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tools", "tool_choice", "tool_parser"),
    [
        (TOOLS, "auto", "qwen3"),
        (TOOLS, "none", "qwen3"),
        (TOOLS, None, "qwen3"),
        (None, "required", "qwen3"),
        (TOOLS, "required", None),
    ],
    ids=["auto", "none", "absent", "no-tools", "no-tool-parser"],
)
def test_nothing_is_enforced_unless_a_call_is_required(tools: Any, tool_choice: Any, tool_parser: str | None) -> None:
    assert tool_call_grammar(tools, tool_choice, tool_parser, reasoning=True) is None


def test_an_unknown_tool_format_is_refused() -> None:
    with pytest.raises(ValueError, match="hermes2"):
        tool_call_grammar(TOOLS, "required", "hermes2", reasoning=False)


# ---- real calls are accepted and read back -----------------------------------------------------------------
JSON_CALLS = [
    ("get_weather", {"city": "Paris", "days": 3}),
    (
        "get_weather",
        {
            "city": 'Zürich "old town"\n',
            "days": 14,
            "unit": "celsius",
            "metric": False,
            "hours": [9, 12, 18],
            "note": None,
        },
    ),
    ("get_weather", {"city": "", "days": 1, "hours": [], "note": "bring \\ an umbrella"}),
    ("now", {}),
]


@pytest.mark.parametrize(("name", "arguments"), JSON_CALLS)
def test_qwen3_json_calls_are_accepted_and_parse_back(accepts: Accepts, name: str, arguments: dict[str, Any]) -> None:
    text = json_call(name, arguments)
    assert accepts(grammar("qwen3"), text)
    assert parsed_calls("qwen3", text) == [(name, arguments)]


def test_the_chat_templates_own_rendering_of_a_call_is_accepted(accepts: Accepts) -> None:
    from transformers import AutoTokenizer

    from engine.weights.demo_model import ensure_demo_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_demo_model()))
    call = {
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "hours": [9]}},
    }
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
        tools=TOOLS,
        tokenize=False,
    )
    block = rendered[rendered.rindex("<tool_call>") : rendered.rindex("</tool_call>") + len("</tool_call>")]
    assert accepts(grammar("qwen3"), block)


XML_CALLS = [
    ({"city": "Paris", "days": "3"}, {"city": "Paris", "days": 3}),
    (
        {
            "city": "São Paulo\nline two",
            "days": "7",
            "unit": "fahrenheit",
            "metric": "true",
            "hours": "[6, 18]",
            "note": "null",
        },
        {
            "city": "São Paulo\nline two",
            "days": 7,
            "unit": "fahrenheit",
            "metric": True,
            "hours": [6, 18],
            "note": None,
        },
    ),
    ({"city": "<b>Paris</b> </param", "days": "-0"}, {"city": "<b>Paris</b> </param", "days": 0}),
]


@pytest.mark.parametrize(("values", "arguments"), XML_CALLS)
def test_qwen3_coder_calls_with_typed_values_are_accepted_and_parse_back(
    accepts: Accepts, values: dict[str, str], arguments: dict[str, Any]
) -> None:
    text = xml_call("get_weather", values)
    assert accepts(grammar("qwen3_coder"), text)
    assert parsed_calls("qwen3_coder", text) == [("get_weather", arguments)]


def test_qwen3_coder_call_of_a_function_without_parameters(accepts: Accepts) -> None:
    text = xml_call("now", {})
    assert accepts(grammar("qwen3_coder"), text)
    assert parsed_calls("qwen3_coder", text) == [("now", {})]


@st.composite
def weather_arguments(draw: st.DrawFn) -> dict[str, Any]:
    text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
    args: dict[str, Any] = {"city": draw(text), "days": draw(st.integers(1, 10**12))}
    optional = {
        "unit": st.sampled_from(["celsius", "fahrenheit"]),
        "metric": st.booleans(),
        "hours": st.lists(st.integers(-(2**62), 2**62), max_size=4),
        "note": st.none() | text,
    }
    for key, strategy in optional.items():  # declared order, any subset
        if draw(st.booleans()):
            args[key] = draw(strategy)
    return args


@settings(max_examples=60, deadline=None)
@given(arguments=weather_arguments())
def test_any_arguments_that_fit_the_schema_are_accepted_and_parse_back(
    accepts: Accepts, arguments: dict[str, Any]
) -> None:
    text = json_call("get_weather", arguments)
    assert accepts(grammar("qwen3"), text)
    assert parsed_calls("qwen3", text) == [("get_weather", arguments)]


# ---- what is refused ---------------------------------------------------------------------------------------
JSON_REJECTED = {
    "unknown-function": json_call("get_time", {}),
    "missing-required": json_call("get_weather", {"city": "Paris"}),
    "undeclared-argument": json_call("get_weather", {"city": "Paris", "days": 3, "country": "FR"}),
    "declared-order-broken": json_call("get_weather", {"days": 3, "city": "Paris"}),
    "string-for-integer": json_call("get_weather", {"city": "Paris", "days": "3"}),
    "negative-below-minimum": json_call("get_weather", {"city": "Paris", "days": -3}),
    "not-in-enum": json_call("get_weather", {"city": "Paris", "days": 3, "unit": "kelvin"}),
    "float-in-integer-array": json_call("get_weather", {"city": "Paris", "days": 3, "hours": [1.5]}),
    "arguments-to-no-parameter-function": json_call("now", {"x": 1}),
    "content-before-the-call": "Sure! " + json_call("now", {}),
    "text-after-the-call": json_call("now", {}) + " done",
    "no-call": "The weather in Paris is sunny.",
    "unclosed-call": json_call("now", {})[: -len("</tool_call>")],
    "think-block-without-reasoning": "<think>hm</think>" + json_call("now", {}),
}


@pytest.mark.parametrize("text", JSON_REJECTED.values(), ids=JSON_REJECTED.keys())
def test_qwen3_grammar_refuses(accepts: Accepts, text: str) -> None:
    assert not accepts(grammar("qwen3"), text)


XML_REJECTED = {
    "unknown-function": xml_call("get_time", {}),
    "missing-required": xml_call("get_weather", {"city": "Paris"}),
    "undeclared-parameter": xml_call("get_weather", {"city": "Paris", "days": "3", "country": "FR"}),
    "word-for-integer": xml_call("get_weather", {"city": "Paris", "days": "three"}),
    "capitalised-boolean": xml_call("get_weather", {"city": "Paris", "days": "3", "metric": "True"}),
    "value-holding-a-closing-tag": xml_call("get_weather", {"city": "Paris</parameter>x", "days": "3"}),
    "value-holding-function-end": xml_call("get_weather", {"city": "a</function>", "days": "3"}),
    "value-holding-a-parameter-tag": xml_call("get_weather", {"city": "a<parameter=days>", "days": "3"}),
    "json-format": json_call("now", {}),
}


@pytest.mark.parametrize("text", XML_REJECTED.values(), ids=XML_REJECTED.keys())
def test_qwen3_coder_grammar_refuses(accepts: Accepts, text: str) -> None:
    assert not accepts(grammar("qwen3_coder"), text)


# ---- tool_choice, parallel calls, reasoning ----------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["qwen3", "qwen3_coder"])
def test_a_named_function_allows_that_function_once(accepts: Accepts, fmt: str) -> None:
    call = (lambda name: json_call(name, {})) if fmt == "qwen3" else (lambda name: xml_call(name, {}))
    g = grammar(fmt, tool_choice=NAMED_NOW)
    assert accepts(g, call("now"))
    assert not accepts(
        g,
        xml_call("get_weather", {"city": "P", "days": "1"})
        if fmt == "qwen3_coder"
        else json_call("get_weather", {"city": "P", "days": 1}),
    )
    assert not accepts(g, call("now") + "\n" + call("now"))


@pytest.mark.parametrize("fmt", ["qwen3", "qwen3_coder"])
@pytest.mark.parametrize(
    ("parallel", "num_calls", "accepted"),
    [
        (True, 1, True),
        (True, 2, True),
        (True, 3, True),
        (False, 1, True),
        (False, 2, False),
    ],
)
def test_several_calls_only_with_parallel_tool_calls(
    accepts: Accepts, fmt: str, parallel: bool, num_calls: int, accepted: bool
) -> None:
    call = json_call("now", {}) if fmt == "qwen3" else xml_call("now", {})
    text = "\n".join([call] * num_calls)
    assert accepts(grammar(fmt, parallel_tool_calls=parallel), text) is accepted
    if accepted:
        assert [name for name, _ in parsed_calls(fmt, text)] == ["now"] * num_calls


@pytest.mark.parametrize(
    ("think", "accepted"),
    [
        ("<think>\nI should call it.\n</think>\n\n", True),
        ("<think></think>", True),
        ("\n<think>\n<b>a < b</b> </thin k>\n</think>\n", True),
        ("", True),  # reasoning may be skipped
        ("<think>\none</think>two</think>\n", False),
        ("<think>\nnever closed\n", False),
        ("Thinking: <think>x</think>", False),
    ],
)
def test_a_think_block_may_precede_the_calls_when_reasoning(accepts: Accepts, think: str, accepted: bool) -> None:
    text = think + json_call("get_weather", {"city": "Paris", "days": 3})
    assert accepts(grammar("qwen3", reasoning=True), text) is accepted
    if accepted:
        assert parsed_calls("qwen3", text, reasoning=True) == [("get_weather", {"city": "Paris", "days": 3})]


@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        ("I should call it.\n</think>\n\n" + xml_call("now", {}), True),
        ("</think>" + xml_call("now", {}), True),
        (xml_call("now", {}), False),  # the open block must be closed first
        ("<think>x</think>" + xml_call("now", {}), True),  # a repeated opening tag is just reasoning text
    ],
)
def test_an_open_think_block_from_the_prompt_must_close_before_the_calls(
    accepts: Accepts, text: str, accepted: bool
) -> None:
    assert accepts(grammar("qwen3_coder", reasoning=True, starts_in_reasoning=True), text) is accepted


WHITESPACE_REFUSED = {
    "no-separator-spaces": json_call("get_weather", {"city": "Paris", "days": 3}, (",", ":")),
    "newline-and-tab-after-colon": json_call("get_weather", {"city": "Paris", "days": 3}).replace(
        '"days": 3', '"days":\n\t3'
    ),
    "space-inside-braces": json_call("now", {}).replace("{}", "{ }"),
    "pretty-printed": '<tool_call>\n{\n  "name": "now",\n  "arguments": {}\n}\n</tool_call>',
    "newline-before-the-closing-brace": json_call("now", {}).replace("{}}", "{}\n}"),
    "space-before-a-comma": json_call("get_weather", {"city": "Paris", "days": 3}).replace('", "days"', '" , "days"'),
    "three-newlines-between-calls": json_call("now", {}) + "\n\n\n" + json_call("now", {}),
    "a-space-before-the-call": " " + json_call("now", {}),
}


@pytest.mark.parametrize("fmt", ["qwen3", "qwen3_coder"])
def test_json_is_compact_with_the_separators_json_dumps_writes(accepts: Accepts, fmt: str) -> None:
    hours = "<parameter=hours>\n[9, 12]\n</parameter>\n"
    g = grammar(fmt)
    if fmt == "qwen3":
        assert accepts(g, json_call("get_weather", {"city": "Paris", "days": 3, "hours": [9, 12]}))
        for text in WHITESPACE_REFUSED.values():
            assert not accepts(g, text), text
        return
    base = xml_call("get_weather", {"city": "Paris", "days": "3"})
    assert accepts(g, base.replace("</function>", hours + "</function>"))
    for spaced in ("[9,12]", "[ 9, 12 ]", "[9,\n 12]"):
        assert not accepts(g, base.replace("</function>", hours.replace("[9, 12]", spaced) + "</function>"))


@pytest.mark.parametrize("between", ["", "\n", "\n\n"])
def test_the_templates_newlines_around_calls_and_think_blocks_are_allowed(accepts: Accepts, between: str) -> None:
    call = json_call("now", {})
    assert accepts(grammar("qwen3"), call + between + call)
    assert accepts(grammar("qwen3", reasoning=True), "<think>\nhm\n</think>" + between + call)
    assert not accepts(grammar("qwen3", reasoning=True), "<think>\nhm\n</think>" + between + "\t" + call)


# ---- JSON schema keywords ----------------------------------------------------------------------------------
TREE = {
    "type": "object",
    "properties": {"value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
    "required": ["value"],
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
            "required": ["value"],
        }
    },
}
SCHEMA_CASES = [
    (
        "recursive-ref",
        TREE,
        [{"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]}],
        [{"value": 1, "children": [{"children": []}]}],
    ),
    ("any-of", {"anyOf": [{"type": "integer"}, {"type": "string", "enum": ["auto"]}]}, [5, "auto"], ["5", 1.5, None]),
    ("const", {"const": {"mode": "fast"}}, [{"mode": "fast"}], [{"mode": "slow"}]),
    ("nullable", {"type": "integer", "nullable": True}, [None, 0], ["null", True]),
    ("type-list", {"type": ["boolean", "null"]}, [True, False, None], [0, "true"]),
    (
        "string-map",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        [{}, {"a": 1, "b c": -2}],
        [{"a": "1"}],
    ),
    ("no-extras-allowed", {"type": "object", "additionalProperties": False}, [{}], [{"a": 1}]),
    ("free-object", {"type": "object"}, [{}, {"a": [1, {"b": None}], "c": "d"}], [[]]),
    (
        "items-bounds",
        {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
        [[1], [1, 2, 3]],
        [[], [1, 2, 3, 4]],
    ),
    (
        "all-optional",
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        [{}, {"a": 1}, {"b": 2}, {"a": 1, "b": 2}],
        [{"b": 2, "a": 1}],
    ),
    ("numbers", {"type": "number"}, [0, -1.5, 2.25e-5, 1e300, 12345678901234567], ["1", True]),
    ("non-negative", {"type": "number", "minimum": 0}, [0, 3.5], [-0.5]),
    ("all-of-one", {"allOf": [{"type": "string"}]}, ["x"], [1]),
    ("no-schema", {}, [1, "x", None, [{}]], []),
]


@pytest.mark.parametrize(
    ("schema", "valid", "invalid"), [c[1:] for c in SCHEMA_CASES], ids=[c[0] for c in SCHEMA_CASES]
)
def test_schema_keywords(accepts: Accepts, schema: dict[str, Any], valid: list[Any], invalid: list[Any]) -> None:
    rules = Rules()
    g = rules.grammar(SchemaGrammar(rules, schema).value(schema, 0))
    for value in valid:
        assert accepts(g, json.dumps(value, ensure_ascii=False)), value
        if json.dumps(value) != json.dumps(value, separators=(",", ":")):
            assert not accepts(g, json.dumps(value, ensure_ascii=False, separators=(",", ":"))), value
    for value in invalid:
        assert not accepts(g, json.dumps(value)), value


def test_unusual_function_names_are_written_verbatim(accepts: Accepts) -> None:
    tool = {
        "type": "function",
        "function": {"name": 'say "hi"\\ünï', "parameters": {"type": "object", "properties": {}}},
    }
    g = tool_call_grammar([tool], "required", "qwen3", reasoning=False)
    assert g is not None
    assert accepts(g, json_call('say "hi"\\ünï', {}))
    assert not accepts(g, json_call("say hi", {}))
