"""JsonObjectStream: re-emits an arguments object so that every emitted prefix closes into
valid JSON, values are the original ones, and broken input is cut at its last sound point."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.parsers.json_stream import JsonObjectStream

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**12), max_value=10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
json_objects = st.dictionaries(st.text(max_size=6), json_values, max_size=5)


def run(text: str, pieces: int = 1) -> tuple[str, JsonObjectStream]:
    """Feed `text` (which starts after the opening brace) in `pieces` parts; "{" + output."""
    stream = JsonObjectStream()
    out = "{"
    step = max(1, -(-len(text) // pieces))
    for i in range(0, len(text), step):
        if stream.stopped:
            break
        out += stream.feed(text[i : i + step])
    return out, stream


@settings(max_examples=150, derandomize=True, deadline=None, database=None)
@given(obj=json_objects, indent=st.sampled_from([None, 0, 2]), ascii_only=st.booleans())
def test_reemitted_object_equals_the_original_and_ends_at_its_brace(
    obj: dict, indent: int | None, ascii_only: bool
) -> None:
    text = json.dumps(obj, indent=indent, ensure_ascii=ascii_only)
    out, stream = run(text[1:] + "\n</tool_call>")
    assert stream.done and not stream.failed
    assert json.loads(out) == obj
    assert stream.end == len(text) - 1  # just past the closing brace, in the fed text


@settings(max_examples=60, derandomize=True, deadline=None, database=None)
@given(obj=json_objects, indent=st.sampled_from([None, 2]))
def test_every_prefix_closes_into_valid_json(obj: dict, indent: int | None) -> None:
    text = json.dumps(obj, indent=indent)[1:]
    stream = JsonObjectStream()
    emitted = "{"
    for ch in text:
        emitted += stream.feed(ch)
        if stream.stopped:
            break
        # Closing a copy of the stream here, mid-object, must give a valid object.
        assert isinstance(json.loads(emitted + copy.deepcopy(stream).close()), dict)
    assert stream.done
    assert json.loads(emitted) == obj


@pytest.mark.parametrize("cut", range(1, 60))
def test_truncated_text_closes_into_valid_json(cut: int) -> None:
    text = '"path": "a\\"b", "n": [1, -2.5e3, {"deep": [true, null]}], "s": "\\u00e9x"}'
    out, stream = run(text[:cut], pieces=3)
    assert not stream.done
    closed = json.loads(out + stream.close())
    assert isinstance(closed, dict)
    full = json.loads("{" + text)
    # What survives is a prefix of the data: every complete key kept has its full value,
    # except possibly the last one, which may be cut.
    keys = list(closed)
    assert keys == list(full)[: len(keys)]
    for k in keys[:-1]:
        assert closed[k] == full[k]


@pytest.mark.parametrize(
    ("text", "expected", "why"),
    [
        ('"a": "x"y"}', '{"a": "x"}', "expected , or closing bracket"),
        ('"a": 1, }', '{"a": 1}', "expected key"),
        ('"a": tru }', "{}", "invalid value 'tru'"),
        ('"a": [1 2]}', '{"a": [1]}', "expected , or closing bracket"),
        ('"a": "\\q"}', '{"a": ""}', "invalid escape"),
        ('"a": NaN}', "{}", "expected value"),
        ('"a" 1}', "{}", "expected :"),
        ('"a": {"b": "c" ]}', '{"a": {"b": "c"}}', "expected , or closing bracket"),
    ],
)
def test_invalid_json_stops_at_the_bad_character_and_closes(text: str, expected: str, why: str) -> None:
    out, stream = run(text)
    assert stream.failed and stream.error is not None and stream.error.startswith(why)
    assert out + stream.close() == expected


def test_raw_control_characters_in_strings_are_escaped() -> None:
    out, stream = run('"code": "a\n\tb"}')
    assert stream.done
    assert out == '{"code": "a\\n\\tb"}'


def test_escape_split_across_feeds_is_held_whole() -> None:
    stream = JsonObjectStream()
    assert stream.feed('"k": "x\\') == '"k": "x'
    assert stream.feed("u00") == ""
    assert stream.feed("e9y") == "\\u00e9y"


def test_key_and_comma_are_held_until_the_value_starts() -> None:
    stream = JsonObjectStream()
    assert stream.feed('"a": 1') == ""  # the number may continue
    assert stream.feed(', "b":') == '"a": 1'
    assert stream.feed(' "') == ', "b": "'
    assert stream.close() == '"}'
