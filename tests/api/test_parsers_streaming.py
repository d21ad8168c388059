"""The shape of what the streaming parsers send: tool-call deltas as the OpenAI SDK
accumulates them, string values streamed before their closing tag, no protocol tag (or a
piece of one) ever in content, held-back text bounded, and the finish-reason rule."""

from __future__ import annotations

import json
import re

import pytest
from openai.lib.streaming._deltas import accumulate_delta

from api.parsers import OutputParser, ParsedDelta, assemble, resolve_finish_reason
from api.parsers.qwen3_coder_tool import Qwen3CoderToolParser
from api.parsers.qwen3_tool import Qwen3ToolParser

CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")
TAGS = ("<tool_call", "</tool_call>", "<think>", "</think>", "<function=", "<parameter=")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "mode": {"type": "integer"}},
            },
        },
    }
]
LONG = 'line "one"\nline <two> & \\three\n' * 3


def hermes_call(path: str, content: str) -> str:
    args = json.dumps({"path": path, "content": content})
    return f'<tool_call>\n{{"name": "write_file", "arguments": {args}}}\n</tool_call>'


def coder_call(path: str, content: str) -> str:
    return (
        f"<tool_call>\n<function=write_file>\n<parameter=path>\n{path}\n</parameter>\n"
        f"<parameter=content>\n{content}\n</parameter>\n<parameter=mode>\n644\n</parameter>\n"
        "</function>\n</tool_call>"
    )


def three_calls(fmt: str) -> str:
    call = hermes_call if fmt == "qwen3" else coder_call
    return "<think>\nWrite three files.\n</think>\n\nWriting.\n" + "\n".join(call(f"f{i}.txt", LONG) for i in range(3))


def stream(parser: OutputParser, pieces: list[str]) -> list[ParsedDelta]:
    deltas = [parser.feed(p) for p in pieces]
    deltas.append(parser.finish())
    return deltas


def make_parser(fmt: str, **kwargs: object) -> OutputParser:
    return OutputParser(fmt, "qwen3", TOOLS, False, **kwargs)


@pytest.mark.parametrize("fmt", ["qwen3", "qwen3_coder"])
def test_first_fragment_announces_call_and_later_ones_carry_only_arguments(fmt: str) -> None:
    deltas = stream(make_parser(fmt), list(three_calls(fmt)))
    fragments = [d for delta in deltas for d in delta.tool_calls]
    headers = [f for f in fragments if f.is_header]
    assert [h.index for h in headers] == [0, 1, 2]
    assert all(CALL_ID.match(h.id) and h.name == "write_file" for h in headers)
    assert len({h.id for h in headers}) == 3
    seen: set[int] = set()
    for f in fragments:
        wire = f.to_openai()
        if f.index not in seen:
            assert f.is_header
            assert wire["type"] == "function" and wire["function"]["name"] == "write_file"
            seen.add(f.index)
        else:
            assert wire == {"index": f.index, "function": {"arguments": f.arguments}}
    assert [h.index for h in headers] == sorted(seen)


@pytest.mark.parametrize("fmt", ["qwen3", "qwen3_coder"])
def test_string_value_streams_before_its_closing_tag(fmt: str) -> None:
    text = three_calls(fmt)
    parser = make_parser(fmt)
    raw = json.dumps(LONG)[1:-1] if fmt == "qwen3" else LONG  # the value as the model writes it
    end_of_first_value = text.index(raw) + len(raw) - 1
    streamed = ""
    for ch in text[:end_of_first_value]:
        for f in parser.feed(ch).tool_calls:
            streamed += f.arguments if f.index == 0 else ""
    # All of the value but its last character is out before the value (or block) ends.
    expected_prefix = json.dumps(LONG[:-1])[1:-1]
    assert expected_prefix in streamed
    fragments = [f for d in stream(make_parser(fmt), list(text)) for f in d.tool_calls]
    assert sum(1 for f in fragments if f.index == 0) > len(LONG) // 2


@pytest.mark.parametrize("fmt", ["qwen3", "qwen3_coder"])
@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7])
def test_no_tag_or_tag_piece_ever_reaches_content_or_reasoning(fmt: str, chunk: int) -> None:
    text = three_calls(fmt) + "\n\nAll written."
    pieces = [text[i : i + chunk] for i in range(0, len(text), chunk)]
    deltas = stream(make_parser(fmt), pieces)
    for d in deltas:
        # The answer's own text has no "<": any "<" in a delta would be a piece of a tag.
        assert "<" not in d.content and "<" not in d.reasoning, d
        assert not any(tag in d.content or tag in d.reasoning for tag in TAGS)
    out = assemble(deltas)
    assert out.content == "Writing.All written."
    assert out.reasoning == "Write three files."


def test_partial_tag_is_held_back_until_resolved() -> None:
    parser = OutputParser("qwen3", None, TOOLS, False)
    assert parser.feed("Hi <tool_c") == ParsedDelta(content="Hi")
    assert parser.feed("") == ParsedDelta()
    assert parser.feed("ool> is a tag name") == ParsedDelta(content=" <tool_cool> is a tag name")
    assert parser.feed(" <").content == ""
    assert parser.finish() == ParsedDelta(content=" <")


def test_partial_think_close_is_held_back_in_reasoning() -> None:
    parser = OutputParser(None, "qwen3", None, True)
    assert parser.feed("a</thi") == ParsedDelta(reasoning="a")
    assert parser.feed("nk>b") == ParsedDelta(content="b")


@pytest.mark.parametrize("fmt", ["qwen3", "qwen3_coder"])
def test_sdk_accumulate_delta_builds_the_same_message_as_assemble(fmt: str) -> None:
    text = three_calls(fmt)
    deltas = stream(make_parser(fmt), [text[i : i + 4] for i in range(0, len(text), 4)])
    acc: dict = {}
    for d in deltas:
        chunk: dict = {}
        if d.content:
            chunk["content"] = d.content
        if d.tool_calls:
            chunk["tool_calls"] = [f.to_openai() for f in d.tool_calls]
        acc = accumulate_delta(acc, chunk)
    out = assemble(deltas)
    assert acc["content"] == out.content
    assert acc["tool_calls"] == [
        {"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
        for i, c in enumerate(out.tool_calls)
    ]
    assert [json.loads(c.arguments_json)["path"] for c in out.tool_calls] == ["f0.txt", "f1.txt", "f2.txt"]
    assert all(json.loads(c.arguments_json)["content"] == LONG for c in out.tool_calls)


@pytest.mark.parametrize(
    ("engine_reason", "made", "expected"),
    [
        ("stop", True, "tool_calls"),
        ("length", True, "length"),
        ("abort", True, "abort"),
        ("stop", False, "stop"),
        ("length", False, "length"),
    ],
)
def test_finish_reason_is_tool_calls_only_for_a_call_that_stopped(
    engine_reason: str, made: bool, expected: str
) -> None:
    assert resolve_finish_reason(engine_reason, made) == expected


def test_tool_calls_made_counts_only_calls_whose_text_closed() -> None:
    parser = OutputParser("qwen3", None, TOOLS, False)
    parser.feed('<tool_call>\n{"name": "write_fi')
    parser.feed('le", "arguments": {"path": "a"}}')
    assert not parser.tool_calls_made  # announced and streamed, but not closed yet
    parser.feed("\n</tool_call>")
    assert parser.tool_calls_made
    parser.finish()
    assert parser.finish_reason("length") == "length"
    assert parser.finish_reason("stop") == "tool_calls"


def test_an_unclosed_streamed_call_is_not_a_call() -> None:
    parser = OutputParser("qwen3", None, TOOLS, False)
    parser.feed('<tool_call>\n{"name": "write_fi')
    parser.feed('le", "arguments": {"path": "a')
    assert parser.finish().is_empty  # no closing quote or brace the model did not write
    assert not parser.tool_calls_made and parser.broken_calls == (0,)
    assert parser.finish_reason("stop") == "stop"


def test_unknown_function_is_never_announced_and_notes_a_problem() -> None:
    parser = OutputParser("qwen3_coder", None, TOOLS, False)
    deltas = stream(parser, list(coder_call("x", "y").replace("write_file", "drop_db")))
    assert not parser.tool_calls_made
    assert all(not d.tool_calls for d in deltas)
    assert parser.problems == ("tool_call block 0: unknown function 'drop_db'; kept as content",)
    assert parser.finish_reason("stop") == "stop"


def test_empty_feeds_return_empty_deltas() -> None:
    parser = OutputParser("qwen3_coder", "qwen3", TOOLS, True)
    assert parser.feed("") == ParsedDelta()
    assert parser.feed("x").reasoning == "x"
    assert parser.feed("") == ParsedDelta()


@pytest.mark.parametrize(("parser_cls", "call"), [(Qwen3ToolParser, hermes_call), (Qwen3CoderToolParser, coder_call)])
def test_held_back_text_stays_bounded_while_a_long_value_streams(parser_cls: type, call: object) -> None:
    # White-box: O(delta) work per feed needs the unscanned buffer to stay tag-sized.
    text = call("big.txt", "x<y </z \n" * 4000)
    parser = parser_cls(TOOLS, lambda: "call_" + "0" * 24)
    emitted = 0
    for i in range(0, len(text), 7):
        delta = parser.feed(text[i : i + 7])
        emitted += sum(len(f.arguments) for f in delta.tool_calls)
        # Before the call is announced the head (name) is held, and it is bounded too.
        assert len(parser._buf) <= (len("</parameter>") if parser.num_calls else 600), i
    parser.finish()
    assert emitted > 36000
