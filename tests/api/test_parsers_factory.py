"""Parser names: `auto` reads the chat template, peers' aliases map onto ours, a misspelt name
is a typed error naming the choices; and the whole-text path equals the streamed one."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.parsers import (
    OutputParser,
    UnknownParserError,
    assemble,
    choose_reasoning_parser,
    choose_tool_parser,
    make_reasoning_parser,
    make_tool_parser,
    parse_text,
    resolve_reasoning_parser,
    resolve_tool_parser,
)
from api.parsers.qwen3_coder_tool import Qwen3CoderToolParser
from api.parsers.qwen3_tool import Qwen3ToolParser

QWEN3_TEMPLATE = Path(__file__).resolve().parents[2] / "engine" / "templates" / "qwen3_chat.jinja"
# The tool-instruction lines of Qwen3-Coder's template (its format, not the whole file).
CODER_TEMPLATE = (
    "{{- '<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\n"
    "value_1\\n</parameter>\\n</function>\\n</tool_call>' }}"
)


@pytest.mark.parametrize(
    ("template", "tool", "reasoning"),
    [
        (CODER_TEMPLATE, "qwen3_coder", None),
        ("{% if tools %}<tool_call>\n{{ call | tojson }}\n</tool_call>{% endif %}<think>", "qwen3", "qwen3"),
        ("{{ messages[0].content }}", None, None),
        (None, None, None),
    ],
)
def test_auto_picks_the_format_the_template_teaches(
    template: str | None, tool: str | None, reasoning: str | None
) -> None:
    assert choose_tool_parser(template) == tool
    assert resolve_tool_parser("auto", template) == tool
    assert choose_reasoning_parser(template) == reasoning
    assert resolve_reasoning_parser("auto", template) == reasoning


def test_auto_on_the_bundled_qwen3_template_is_qwen3_for_both() -> None:
    template = QWEN3_TEMPLATE.read_text()
    assert (resolve_tool_parser("auto", template), resolve_reasoning_parser("auto", template)) == ("qwen3", "qwen3")


@pytest.mark.parametrize(
    ("name", "resolved"),
    [
        ("qwen3", "qwen3"),
        ("hermes", "qwen3"),
        ("qwen25", "qwen3"),
        ("qwen3_xml", "qwen3_coder"),
        ("none", None),
        (None, None),
    ],
)
def test_peer_aliases_resolve_to_our_parsers(name: str | None, resolved: str | None) -> None:
    assert resolve_tool_parser(name) == resolved


def test_make_returns_the_named_parser_class() -> None:
    assert isinstance(make_tool_parser("hermes", None), Qwen3ToolParser)
    assert isinstance(make_tool_parser("auto", None, chat_template=CODER_TEMPLATE), Qwen3CoderToolParser)
    assert make_reasoning_parser("qwen3", True).feed("x").reasoning == "x"


@pytest.mark.parametrize(
    ("call", "kind"),
    [
        (lambda: resolve_tool_parser("mistral"), "tool"),
        (lambda: resolve_reasoning_parser("deepseek_r1"), "reasoning"),
        (lambda: make_tool_parser("auto", None, chat_template="plain"), "tool"),
        (lambda: OutputParser("qwen4", None, None, False), "tool"),
    ],
)
def test_unknown_names_raise_a_typed_error_listing_choices(call: object, kind: str) -> None:
    with pytest.raises(UnknownParserError) as info:
        call()
    assert info.value.kind == kind
    assert "qwen3" in str(info.value)


def test_parse_text_equals_streaming_char_by_char() -> None:
    text = (
        "<think>\nfind it\n</think>\n\nLooking.\n<tool_call>\n"
        '{"name": "grep", "arguments": {"pattern": "a\\\\d+", "paths": ["x", "y"]}}\n</tool_call>'
    )
    ids = iter(f"call_{i:024x}" for i in range(10))
    whole = parse_text(text, "qwen3", "qwen3", None, False, call_id_factory=lambda: next(ids))
    ids = iter(f"call_{i:024x}" for i in range(10))
    parser = OutputParser("qwen3", "qwen3", None, False, call_id_factory=lambda: next(ids))
    streamed = assemble([*(parser.feed(ch) for ch in text), parser.finish()])
    assert whole == streamed
    assert whole.content == "Looking." and whole.reasoning == "find it"
    assert whole.tool_calls[0].arguments_json == '{"pattern": "a\\\\d+", "paths": ["x", "y"]}'
