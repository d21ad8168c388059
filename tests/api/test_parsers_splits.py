"""Every parser combination, fed the same model outputs whole, split at every character
boundary, char by char, and at random token-like splits, assembles to one hand-written
answer (content, reasoning, tool calls with parsed arguments) — the split never matters."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.parsers import OutputParser, ParsedOutput, assemble

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
RUN = {
    "type": "function",
    "function": {
        "name": "run",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string"},
                "count": {"type": "integer"},
                "ratio": {"type": "number"},
                "verbose": {"type": "boolean"},
                "env": {"type": "object"},
                "files": {"type": "array", "items": {"type": "string"}},
                "nothing": {"type": "null"},
                "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                "tag": {"type": ["string", "null"]},
            },
        },
    },
}
TOOLS = [WEATHER, RUN]


@dataclass(frozen=True)
class Case:
    id: str
    tool_parser: str | None
    reasoning_parser: str | None
    starts_in_reasoning: bool
    text: str
    content: str | None
    reasoning: str | None
    calls: tuple[tuple[str, dict], ...] = ()
    parallel_tool_calls: bool = True


def hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def coder(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={p}>\n{v}\n</parameter>\n" for p, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


THINK = "<think>\nThe user wants the weather; I'll call the tool.\n</think>\n\n"
THOUGHT = "The user wants the weather; I'll call the tool."

REASONING_CASES = [
    Case("plain", None, "qwen3", False, "Hello, world!\n", "Hello, world!\n", None),
    Case("think_then_content", None, "qwen3", False, THINK + "It is sunny.", "It is sunny.", THOUGHT),
    Case(
        "think_in_prompt",
        None,
        "qwen3",
        True,
        "Plan: answer briefly.\n</think>\n\nFour.",
        "Four.",
        "Plan: answer briefly.",
    ),
    Case(
        "never_closed_is_all_reasoning",
        None,
        "qwen3",
        True,
        "Compare a < b and </th tags...",
        None,
        "Compare a < b and </th tags...",
    ),
    Case("thinking_off_is_content", None, "qwen3", False, "2 + 2 = 4", "2 + 2 = 4", None),
    Case(
        "repeated_open_tag_and_stray_close",
        None,
        "qwen3",
        True,
        "<think>\nhmm\n</think>\n\nA</think> B",
        "AB",
        "hmm",
    ),
    Case("empty_output", None, "qwen3", True, "", None, None),
]

HERMES_CASES = [
    Case("plain", "qwen3", "qwen3", False, "Just text, no tools.", "Just text, no tools.", None),
    Case("think_then_content", "qwen3", "qwen3", False, THINK + "Sunny.", "Sunny.", THOUGHT),
    Case(
        "think_then_two_calls",
        "qwen3",
        "qwen3",
        False,
        THINK
        + "Checking both.\n\n"
        + hermes("get_weather", '{"city": "Paris"}')
        + "\n"
        + hermes("get_weather", '{"city": "Oslo", "days": 3}'),
        "Checking both.",
        THOUGHT,
        (("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "days": 3})),
    ),
    Case(
        "nested_escaped_unicode",
        "qwen3",
        None,
        False,
        hermes(
            "run",
            '{"code": "print(\\"hi\\")\\n\\tx = \'\\\\\\\\\'", "env": {"A": [1, 2.5e3, -0.5, true, '
            'false, null, {"k": []}]}, "files": ["ünï.py", "日本.txt", "\\u00e9\\ud83d\\ude00"]}',
        ),
        None,
        None,
        (
            (
                "run",
                {
                    "code": "print(\"hi\")\n\tx = '\\\\'",
                    "env": {"A": [1, 2500.0, -0.5, True, False, None, {"k": []}]},
                    "files": ["ünï.py", "日本.txt", "é😀"],
                },
            ),
        ),
    ),
    Case(
        "no_arguments_and_reordered_keys",
        "qwen3",
        None,
        False,
        '<tool_call>\n{"name": "run"}\n</tool_call>'
        '<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>',
        None,
        None,
        (("run", {}), ("get_weather", {"city": "Rome"})),
    ),
    Case(
        "invalid_json_before_announcing_is_content",
        "qwen3",
        "qwen3",
        False,
        "Try:\n<tool_call>\n{name: get_weather}\n</tool_call>",
        "Try:\n<tool_call>\n{name: get_weather}\n</tool_call>",
        None,
    ),
    Case(
        "invalid_json_after_announcing_is_content_not_an_invented_call",
        "qwen3",
        None,
        False,
        hermes("get_weather", '{"city": "Pa"ris", "days": 2}') + "\nDone.",
        hermes("get_weather", '{"city": "Pa"ris", "days": 2}') + "\nDone.",
        None,
        (),
    ),
    Case(
        "unclosed_block_truncated_in_a_string",
        "qwen3",
        None,
        False,
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        None,
        (),
    ),
    Case(
        "unclosed_block_before_the_name_is_content",
        "qwen3",
        None,
        False,
        'Sure. <tool_call>\n{"name": "get_w',
        'Sure. <tool_call>\n{"name": "get_w',
        None,
    ),
    Case(
        "unknown_function_is_content",
        "qwen3",
        None,
        False,
        hermes("delete_everything", "{}") + "\n" + hermes("get_weather", '{"city": "Lima"}'),
        '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',
        None,
        (("get_weather", {"city": "Lima"}),),
    ),
    Case(
        "missing_name_is_content",
        "qwen3",
        None,
        False,
        '<tool_call>{"arguments": {"city": "Lima"}}</tool_call>',
        '<tool_call>{"arguments": {"city": "Lima"}}</tool_call>',
        None,
    ),
    Case(
        "tool_call_inside_reasoning_stays_reasoning",
        "qwen3",
        "qwen3",
        True,
        'Maybe <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>? No.\n</think>\n\nNo tool needed.',
        "No tool needed.",
        'Maybe <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>? No.',
    ),
    Case(
        "parallel_off_keeps_first_call_only",
        "qwen3",
        None,
        False,
        hermes("get_weather", '{"city": "A"}') + hermes("get_weather", '{"city": "B"}') + "bye",
        "bye",
        None,
        (("get_weather", {"city": "A"}),),
        parallel_tool_calls=False,
    ),
]

CODER_CASES = [
    Case("plain", "qwen3_coder", "qwen3", False, "Nothing to call.", "Nothing to call.", None),
    Case("think_then_content", "qwen3_coder", "qwen3", False, THINK + "Sunny.", "Sunny.", THOUGHT),
    Case(
        "think_then_two_calls",
        "qwen3_coder",
        "qwen3",
        True,
        THINK.removeprefix("<think>\n")
        + "Both cities.\n"
        + coder("get_weather", ("city", "Paris"), ("days", "2"))
        + "\n"
        + coder("get_weather", ("city", "Oslo")),
        "Both cities.",
        THOUGHT,
        (("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Oslo"})),
    ),
    Case(
        "every_schema_type",
        "qwen3_coder",
        None,
        False,
        coder(
            "run",
            ("code", 'def f(x):\n    return "<b>" + x\n\n'),
            ("count", "42"),
            ("ratio", "0.25"),
            ("verbose", "True"),
            ("env", '{"PATH": "/bin", "N": [1, 2]}'),
            ("files", "['a.py', 'b.py']"),
            ("nothing", "null"),
            ("limit", "null"),
            ("tag", "None"),
            ("extra", "7"),
            ("count_text", "x"),
        ),
        None,
        None,
        (
            (
                "run",
                {
                    "code": 'def f(x):\n    return "<b>" + x\n\n',
                    "count": 42,
                    "ratio": 0.25,
                    "verbose": True,
                    "env": {"PATH": "/bin", "N": [1, 2]},
                    "files": ["a.py", "b.py"],
                    "nothing": None,
                    "limit": None,
                    "tag": None,
                    "extra": "7",
                    "count_text": "x",
                },
            ),
        ),
    ),
    Case(
        "unconvertible_values_stay_strings",
        "qwen3_coder",
        None,
        False,
        coder("run", ("count", "many"), ("ratio", "nan"), ("env", "{oops"), ("limit", "3")),
        None,
        None,
        (("run", {"count": "many", "ratio": "nan", "env": "{oops", "limit": 3}),),
    ),
    Case(
        "parameters_end_at_next_parameter_or_function_end",
        "qwen3_coder",
        None,
        False,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nKyiv\n<parameter=days>\n4\n</function>\n</tool_call>",
        None,
        None,
        (("get_weather", {"city": "Kyiv", "days": 4}),),
    ),
    Case(
        "unknown_function_is_content",
        "qwen3_coder",
        None,
        False,
        "Hm.\n" + coder("rm_rf", ("path", "/")),
        "Hm.\n" + coder("rm_rf", ("path", "/")),
        None,
    ),
    Case(
        "unclosed_block_truncated_in_a_value",
        "qwen3_coder",
        None,
        False,
        "<tool_call>\n<function=run>\n<parameter=count>\n3\n</parameter>\n<parameter=code>\nimport os\npri",
        "<tool_call>\n<function=run>\n<parameter=count>\n3\n</parameter>\n<parameter=code>\nimport os\npri",
        None,
        (),
    ),
    Case(
        "tool_call_inside_reasoning_stays_reasoning",
        "qwen3_coder",
        "qwen3",
        False,
        "<think>\nI could <tool_call>\n<function=run>\n</function>\n</tool_call> later.\n</think>\n\nOK.",
        "OK.",
        "I could <tool_call>\n<function=run>\n</function>\n</tool_call> later.",
    ),
    Case(
        "empty_and_null_like_strings",
        "qwen3_coder",
        None,
        False,
        coder("get_weather", ("city", ""), ("days", "1"))
        + coder("run", ("code", "null"), ("tag", "nullable"), ("files", "[]")),
        None,
        None,
        (
            ("get_weather", {"city": "", "days": 1}),
            ("run", {"code": "null", "tag": "nullable", "files": []}),
        ),
    ),
    Case(
        "two_functions_in_one_block",
        "qwen3_coder",
        None,
        False,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n</function>\n"
        "<function=get_weather>\n<parameter=city>\nB\n</parameter>\n</function>\n</tool_call>",
        None,
        None,
        (("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})),
    ),
]

CASES = [*REASONING_CASES, *HERMES_CASES, *CODER_CASES]
CASE_IDS = [f"{c.tool_parser or 'none'}-{c.reasoning_parser or 'none'}-{c.id}" for c in CASES]


def make_parser(case: Case, streaming: bool = False) -> OutputParser:
    return OutputParser(
        case.tool_parser,
        case.reasoning_parser,
        TOOLS,
        case.starts_in_reasoning,
        case.parallel_tool_calls,
        streaming=streaming,
    )


def parse_pieces(case: Case, pieces: list[str], streaming: bool = False) -> ParsedOutput:
    """The answer as a non-streamed reply gives it, or (`streaming`) as a client assembles the
    stream's deltas."""
    parser = make_parser(case, streaming)
    deltas = [parser.feed(p) for p in pieces]
    deltas.append(parser.finish())
    return assemble(deltas)


def comparable(out: ParsedOutput) -> tuple:
    """Everything but the random ids."""
    return (out.content, out.reasoning, [(c.name, c.arguments_json) for c in out.tool_calls])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_whole_text_matches_hand_written_answer(case: Case) -> None:
    out = parse_pieces(case, [case.text])
    assert out.content == case.content
    assert out.reasoning == case.reasoning
    assert [(c.name, json.loads(c.arguments_json)) for c in out.tool_calls] == list(case.calls)
    assert len({c.id for c in out.tool_calls}) == len(out.tool_calls)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("streaming", [False, True])
def test_every_two_piece_split_and_char_by_char_give_the_same_answer(case: Case, streaming: bool) -> None:
    whole = comparable(parse_pieces(case, [case.text], streaming))
    for i in range(len(case.text) + 1):
        assert comparable(parse_pieces(case, [case.text[:i], case.text[i:]], streaming)) == whole, i
    assert comparable(parse_pieces(case, list(case.text), streaming)) == whole


@st.composite
def token_like_splits(draw: st.DrawFn, text: str) -> list[str]:
    """Pieces of 0-8 characters (a token's worth, or an empty feed); the rest in one piece."""
    lengths = draw(st.lists(st.integers(min_value=0, max_value=8), max_size=len(text)))
    pieces, i = [], 0
    for n in lengths:
        pieces.append(text[i : i + n])
        i += n
    pieces.append(text[i:])
    return pieces


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_random_token_like_splits_give_the_same_answer(case: Case) -> None:
    whole = comparable(parse_pieces(case, [case.text]))

    @settings(max_examples=40, derandomize=True, deadline=None, database=None)
    @given(token_like_splits(case.text))
    def check(pieces: list[str]) -> None:
        assert "".join(pieces) == case.text
        assert comparable(parse_pieces(case, pieces)) == whole

    check()


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<think>", "</think>", "<function=get_weather>",
    "<function=nope>", "<function=run>", "<parameter=city>", "<parameter=days>",
    "<parameter=env>", "</parameter>", "</function>",
    '{"name": "get_weather", "arguments": {', '{"name": "run", "arguments": ',
    '"city": "', '"days": ', '"', "{", "}", "[", "]", ",", ":", "12", "null", "\\", "\\u00e9",
    "\n", " ", "x", "<", ">", "</", "é", "<tool_c", "</thi",
]  # fmt: skip


@pytest.mark.parametrize(
    ("tool_parser", "reasoning_parser", "starts_in_reasoning"),
    [("qwen3", "qwen3", False), ("qwen3_coder", "qwen3", True), ("qwen3", None, False), ("qwen3_coder", None, False)],
)
@settings(max_examples=150, derandomize=True, deadline=None, database=None)
@given(data=st.data())
def test_arbitrary_tag_soup_never_raises_and_never_depends_on_the_split(
    tool_parser: str, reasoning_parser: str | None, starts_in_reasoning: bool, data: st.DataObject
) -> None:
    text = "".join(data.draw(st.lists(st.sampled_from(FRAGMENTS), max_size=40)))
    case = Case("soup", tool_parser, reasoning_parser, starts_in_reasoning, text, None, None)
    whole = parse_pieces(case, [text])
    for c in whole.tool_calls:
        assert isinstance(json.loads(c.arguments_json), dict)
        assert c.name in ("get_weather", "run")
    assert comparable(parse_pieces(case, list(text))) == comparable(whole)
    assert comparable(parse_pieces(case, data.draw(token_like_splits(text)))) == comparable(whole)
    streamed = comparable(parse_pieces(case, [text], streaming=True))
    assert comparable(parse_pieces(case, data.draw(token_like_splits(text)), streaming=True)) == streamed


@st.composite
def mutated_outputs(draw: st.DrawFn) -> tuple[Case, str]:
    """A well-formed case's text with 1-3 spans deleted, duplicated or replaced by a tag or
    a JSON piece: near-misses of the formats, as a model's slips are."""
    case = draw(st.sampled_from([c for c in CASES if c.tool_parser]))
    text = case.text
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        i = draw(st.integers(min_value=0, max_value=len(text)))
        j = min(len(text), i + draw(st.integers(min_value=1, max_value=12)))
        op = draw(st.sampled_from(["delete", "insert", "duplicate"]))
        if op == "delete":
            text = text[:i] + text[j:]
        elif op == "insert":
            text = text[:i] + draw(st.sampled_from(FRAGMENTS)) + text[i:]
        else:
            text = text[:i] + text[i:j] + text[i:]
    return case, text


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(mutated=mutated_outputs(), data=st.data())
def test_damaged_outputs_never_raise_and_never_depend_on_the_split(
    mutated: tuple[Case, str], data: st.DataObject
) -> None:
    case, text = mutated
    whole = parse_pieces(case, [text])
    for c in whole.tool_calls:
        assert isinstance(json.loads(c.arguments_json), dict)
    assert comparable(parse_pieces(case, list(text))) == comparable(whole)
    assert comparable(parse_pieces(case, data.draw(token_like_splits(text)))) == comparable(whole)
    streamed = comparable(parse_pieces(case, [text], streaming=True))
    assert comparable(parse_pieces(case, data.draw(token_like_splits(text)), streaming=True)) == streamed
