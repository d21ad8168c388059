"""`--tool-parser qwen3` (hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
one call per block, arguments streamed as they arrive.

How a block is read (every outcome is a pure function of the whole text):
- Streamed: when the block starts `{"name": "<known name>", "arguments": {`, the call is
  announced at that `{` (id, name, arguments "{"), and the arguments object is re-emitted
  through `JsonObjectStream` as it arrives: string values character by character.
- Read whole: any other start (keys in another order, a name not in `tools`, not JSON) is
  collected up to `</tool_call>` and parsed with `json.loads`. A valid object with a known
  `name` and an `arguments` (or `parameters`) object, or JSON text of one, or none at all
  (`{}`), is one call, sent in one delta. Anything else is returned verbatim, tags included,
  as content.
- Broken after announcing: a call is one only once its `</tool_call>` is read. If its
  arguments turn out invalid JSON, the text ends inside the block (max_tokens), or a new
  `<tool_call>` starts before it closed, the call is broken (api/parsers/tool_stream.py): a
  stream sends nothing more for it, and a whole reply keeps the block's text as content.
- After the arguments object, everything up to `</tool_call>` (the outer `}`) is dropped.
"""

from __future__ import annotations

import enum
import json
import re

from api.parsers.base import CallIdFactory
from api.parsers.json_stream import JsonObjectStream
from api.parsers.tags import TagSet, find_first_tag, partial_tag_start
from api.parsers.tool_stream import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolStream

# The canonical head, token by token; None stands for the name string.
_HEAD_TOKENS: tuple[str | None, ...] = ("{", '"name"', ":", None, ",", '"arguments"', ":", "{")
# Past this many characters a head that has not completed is read whole instead (OpenAI
# limits names to 64 characters), which keeps the re-scan per feed bounded.
_HEAD_MAX = 512
_WS = re.compile(r"[ \t\n\r]*")
_STRING_BODY = re.compile(r'(?:[^"\\]|\\.)*', re.S)
_AFTER_TAGS = TagSet((TOOL_CALL_CLOSE, TOOL_CALL_OPEN))


class _State(enum.Enum):
    HEAD = "head"  # reading `{"name": "...", "arguments": {`
    BUFFERED = "buffered"  # not the canonical head: read to </tool_call>, then json.loads
    ARGS = "args"  # announced: streaming the arguments object
    AFTER = "after"  # call done: dropping text up to </tool_call>


def match_head(text: str) -> tuple[str, int] | bool:
    """Match the canonical head at the start of `text`: (name, end) when complete, True when
    `text` could still grow into it, False when it cannot."""
    pos = 0
    name = ""
    for token in _HEAD_TOKENS:
        pos = _WS.match(text, pos).end()
        if pos == len(text):
            return True
        if token is None:
            if text[pos] != '"':
                return False
            end = _STRING_BODY.match(text, pos + 1).end()
            if end == len(text) or text[end] == "\\":
                return True  # the string (or an escape in it) is still open
            try:
                name = json.loads(text[pos : end + 1])
            except ValueError:
                return False
            pos = end + 1
            continue
        part = text[pos : pos + len(token)]
        if not token.startswith(part):
            return False
        if len(part) < len(token):
            return True
        pos += len(token)
    return name, pos


def parse_call_json(inner: str) -> tuple[str, str] | str:
    """A whole block's JSON: (name, arguments as JSON text), or why it is not a call."""
    try:
        obj = json.loads(inner, strict=False, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        return f"invalid JSON ({str(e)[:80]})"
    if not isinstance(obj, dict):
        return "JSON is not an object"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return "no function name"
    arguments = obj.get("arguments", obj.get("parameters"))
    if arguments is None:
        arguments = {}  # a call of a function without parameters
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, strict=False, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            return "arguments are a string but not JSON"
    if not isinstance(arguments, dict):
        return "arguments are not an object"
    return name, json.dumps(arguments, ensure_ascii=False)


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


class Qwen3ToolParser(ToolStream):
    """Streaming hermes-style parser; O(len(text)) per feed."""

    def __init__(self, tools: list[dict] | None, new_call_id: CallIdFactory, streaming: bool = True) -> None:
        super().__init__(tools, new_call_id, streaming)
        self._state = _State.HEAD
        self._args: JsonObjectStream | None = None
        self._after_text: list[str] = []

    def _begin_block(self) -> None:
        self._state = _State.HEAD

    def _step_block(self) -> bool:
        if self._state is _State.HEAD:
            return self._step_head()
        if self._state is _State.BUFFERED:
            return self._step_buffered()
        if self._state is _State.ARGS:
            return self._step_args()
        return self._step_after()

    def _step_head(self) -> bool:
        # The head stays in `_buf` (bounded by _HEAD_MAX) until it completes or cannot.
        head = self._buf[:_HEAD_MAX]
        found = match_head(head)
        if found is True and len(head) < _HEAD_MAX:
            return False
        if isinstance(found, tuple) and self._known(found[0]):
            name, end = found
            self._buf = self._buf[end:]
            self._announce(name, "{")
            self._args = JsonObjectStream()
            self._state = _State.ARGS
            return True
        self._state = _State.BUFFERED
        return True

    def _close_buffered(self, inner: str, closed: bool) -> None:
        parsed = parse_call_json(inner) if closed else "text ended before </tool_call>"
        if isinstance(parsed, str):
            self._fail_block(parsed, closed)
        elif not self._known(parsed[0]):
            self._fail_block(f"unknown function {parsed[0]!r}", closed)
        else:
            self._announce(*parsed)
            self._end_block()

    def _step_args(self) -> bool:
        assert self._args is not None
        self._emit_arguments(self._args.feed(self._buf))
        if not self._args.stopped:
            self._buf = ""
            return False
        assert self._args.end is not None
        if self._args.failed:
            self._break_call(f"arguments {self._args.error}")
        self._buf = self._buf[self._args.end :]
        self._args = None
        self._after_text.clear()
        self._state = _State.AFTER
        return True

    def _step_after(self) -> bool:
        found = find_first_tag(self._buf, _AFTER_TAGS)
        if found is None:
            cut = partial_tag_start(self._buf, _AFTER_TAGS)
            self._after_text.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        i, tag = found
        self._after_text.append(self._buf[:i])
        if tag == TOOL_CALL_OPEN:
            # An unclosed block followed by the next one: the tag stays for content to read.
            self._break_call("a new <tool_call> began before </tool_call>")
            self._buf = self._buf[i:]
        else:
            self._buf = self._buf[i + len(tag) :]
        self._end_after()
        return True

    def _end_after(self) -> None:
        dropped = "".join(self._after_text).strip()
        if dropped not in ("}", ""):
            self.problems.append(f"tool call {self.num_calls - 1}: dropped {dropped[:40]!r} after the arguments")
        self._after_text.clear()
        self._end_block()

    def _finish_block(self) -> None:
        if self._state is _State.HEAD or self._state is _State.BUFFERED:
            self._finish_buffered()
            return
        if self._state is _State.ARGS:
            assert self._args is not None and not self._buf, "ARGS consumes all it is fed"
            self._break_call("text ended inside the arguments")
            self._args = None
        self._break_call("text ended before </tool_call>")
        self._buf = ""
        self._end_after()
