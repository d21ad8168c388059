"""`--tool-parser qwen3_coder`: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>
\\n...</function>\\n</tool_call>`, with arguments streamed as JSON while values arrive.

How a block is read (every outcome is a pure function of the whole text):
- The call is announced (id, name, arguments "{") as soon as `<function=NAME>` is complete
  and NAME is known (any name when no tools are given). A block that does not start that way
  (no `<function=`, unknown name, a `<` or newline inside the name) is collected up to
  `</tool_call>` and returned verbatim, tags included, as content.
- A parameter's value ends at `</parameter>`, the next `<parameter=`, `</function>` or
  `</tool_call>`, whichever comes first; one leading and one trailing newline are stripped.
  String values (and parameters the schema does not list) stream as escaped characters;
  other types are converted (schema_types) and emitted as `json.dumps` at the value's end.
- The arguments object closes at `</function>` or `</tool_call>`; text between parameters is
  dropped (noted in `problems`). If the text ends inside the call (max_tokens) the call is
  broken (api/parsers/tool_stream.py): a stream sends nothing more for it (no closing quote
  or brace), and a whole reply keeps its text as content.
- After `</function>` text up to `</tool_call>` is dropped; another `<function=` there is a
  further call from the same block; `<tool_call>` starts the next block.
"""

from __future__ import annotations

import enum
import json

from api.parsers.base import CallIdFactory
from api.parsers.param_value import ConvertedValue, StringValue
from api.parsers.schema_types import STRING, param_type
from api.parsers.tags import TagSet, find_first_tag, partial_tag_start
from api.parsers.tool_stream import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolStream

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"
_PARAMS_TAGS = TagSet((PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE))
_VALUE_END_TAGS = TagSet((PARAMETER_CLOSE, PARAMETER_OPEN, FUNCTION_CLOSE, TOOL_CALL_CLOSE))
_AFTER_TAGS = TagSet((TOOL_CALL_CLOSE, TOOL_CALL_OPEN, FUNCTION_OPEN))
# A function or parameter name must close with `>` within this many characters; the bound
# keeps the per-feed re-scan of a name O(1).
_NAME_MAX = 256


class _State(enum.Enum):
    FUNC_HEAD = "function head"  # expecting `<function=NAME>`
    BUFFERED = "buffered"  # not a call: collecting the block for content
    PARAMS = "params"  # inside a function, between parameters
    PARAM_NAME = "parameter name"  # after `<parameter=`, up to `>`
    VALUE = "value"  # inside a parameter value
    AFTER = "after"  # after `</function>`, dropping text up to `</tool_call>`


class Qwen3CoderToolParser(ToolStream):
    """Streaming Qwen3-Coder XML tool-call parser; O(len(text)) per feed."""

    def __init__(self, tools: list[dict] | None, new_call_id: CallIdFactory, streaming: bool = True) -> None:
        super().__init__(tools, new_call_id, streaming)
        self._state = _State.FUNC_HEAD
        self._continuing = False  # this block already produced a call
        self._why = ""  # why a BUFFERED block is not a call
        self._properties: dict = {}  # the current function's `parameters.properties`
        self._num_params = 0
        self._value: StringValue | ConvertedValue | None = None
        self._dropped: list[str] = []

    def _begin_block(self) -> None:
        self._state = _State.FUNC_HEAD
        self._continuing = False

    def _step_block(self) -> bool:
        state = self._state
        if state is _State.FUNC_HEAD:
            return self._step_function_head()
        if state is _State.BUFFERED:
            return self._step_buffered()
        if state is _State.PARAMS:
            return self._step_params()
        if state is _State.PARAM_NAME:
            return self._step_param_name()
        if state is _State.VALUE:
            return self._step_value()
        return self._step_after()

    def _step_function_head(self) -> bool:
        head = self._buf.lstrip()
        if len(head) < len(self._buf):
            # Leading whitespace moves to the block's raw text now, so that a long run of it
            # is not re-scanned on every feed.
            self._raw.append(self._buf[: len(self._buf) - len(head)])
            self._buf = head
        if FUNCTION_OPEN.startswith(head):
            return False  # a partial `<function=` so far
        if not head.startswith(FUNCTION_OPEN):
            return self._not_a_call("no <function=NAME> at the start")
        window = head[len(FUNCTION_OPEN) : len(FUNCTION_OPEN) + _NAME_MAX + 1]
        j = window.find(">")
        raw_name = window if j == -1 else window[:j]
        if "<" in raw_name or "\n" in raw_name:
            return self._not_a_call("malformed <function=NAME>")
        if j == -1:
            if len(window) > _NAME_MAX:
                return self._not_a_call("function name too long")
            return False
        name = raw_name.strip()
        if not self._known(name):
            return self._not_a_call(f"unknown function {name!r}")
        self._buf = head[len(FUNCTION_OPEN) + j + 1 :]
        self._announce(name, "{")
        schema = self._parameters_schema(name) or {}
        properties = schema.get("properties")
        self._properties = properties if isinstance(properties, dict) else {}
        self._num_params = 0
        self._dropped.clear()
        self._state = _State.PARAMS
        return True

    def _not_a_call(self, why: str) -> bool:
        if self._continuing:
            # A further function in a block that already made a call: drop it, tag and all
            # (AFTER put the `<function=` back; leaving it would find it again forever).
            self.problems.append(f"tool_call block {self._num_blocks - 1}: {why}; dropped")
            assert self._buf.startswith(FUNCTION_OPEN), "AFTER hands over at a `<function=`"
            self._buf = self._buf[len(FUNCTION_OPEN) :]
            self._state = _State.AFTER
        else:
            self._why = why
            self._state = _State.BUFFERED
        return True

    def _close_buffered(self, inner: str, closed: bool) -> None:
        self._fail_block(self._why, closed)

    def _step_params(self) -> bool:
        found = find_first_tag(self._buf, _PARAMS_TAGS)
        if found is None:
            cut = partial_tag_start(self._buf, _PARAMS_TAGS)
            self._dropped.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        i, tag = found
        self._dropped.append(self._buf[:i])
        self._buf = self._buf[i + len(tag) :]
        if tag == PARAMETER_OPEN:
            self._state = _State.PARAM_NAME
        else:
            self._close_call(tag)
        return True

    def _step_param_name(self) -> bool:
        j = self._buf.find(">", 0, _NAME_MAX + 1)
        if j == -1:
            if len(self._buf) <= _NAME_MAX:
                return False
            self._dropped.append(PARAMETER_OPEN + self._buf[: _NAME_MAX + 1])
            self._buf = self._buf[_NAME_MAX + 1 :]
            self._state = _State.PARAMS
            return True
        name = self._buf[:j].strip()
        self._buf = self._buf[j + 1 :]
        self._value = self._new_value(name)
        self._state = _State.VALUE
        return True

    def _new_value(self, name: str) -> StringValue | ConvertedValue:
        key_prefix = (", " if self._num_params else "") + json.dumps(name, ensure_ascii=False) + ": "
        self._num_params += 1
        # Parameters the schema does not list stay strings.
        ptype = param_type(self._properties[name]) if name in self._properties else STRING
        if ptype.is_string:
            return StringValue(key_prefix, ptype.nullable)
        return ConvertedValue(key_prefix, ptype)

    def _step_value(self) -> bool:
        assert self._value is not None
        found = find_first_tag(self._buf, _VALUE_END_TAGS)
        if found is None:
            cut = partial_tag_start(self._buf, _VALUE_END_TAGS)
            self._emit_arguments(self._value.feed(self._buf[:cut]))
            self._buf = self._buf[cut:]
            return False
        i, tag = found
        self._emit_arguments(self._value.end(self._buf[:i]))
        self._value = None
        self._buf = self._buf[i + len(tag) :]
        if tag == PARAMETER_CLOSE:
            self._state = _State.PARAMS
        elif tag == PARAMETER_OPEN:
            self._state = _State.PARAM_NAME
        else:
            self._close_call(tag)
        return True

    def _close_call(self, tag: str) -> None:
        self._emit_arguments("}")
        self._commit_call()
        dropped = "".join(self._dropped).strip()
        if dropped:
            self.problems.append(f"tool call {self.num_calls - 1}: dropped {dropped[:40]!r} between parameters")
        self._dropped.clear()
        self._continuing = True
        if tag == FUNCTION_CLOSE:
            self._state = _State.AFTER
        else:
            self._end_block()

    def _step_after(self) -> bool:
        found = find_first_tag(self._buf, _AFTER_TAGS)
        if found is None:
            cut = partial_tag_start(self._buf, _AFTER_TAGS)
            self._dropped.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        i, tag = found
        self._dropped.append(self._buf[:i])
        self._buf = self._buf[i:] if tag != TOOL_CALL_CLOSE else self._buf[i + len(tag) :]
        dropped = "".join(self._dropped).strip()
        if dropped:
            self.problems.append(f"tool_call block {self._num_blocks - 1}: dropped {dropped[:40]!r}")
        self._dropped.clear()
        if tag == FUNCTION_OPEN:
            self._state = _State.FUNC_HEAD  # the `<function=` stays in _buf for the head
        else:
            self._end_block()  # an opening `<tool_call>` stays in _buf for content to read
        return True

    def _finish_block(self) -> None:
        state = self._state
        if state is _State.BUFFERED or (state is _State.FUNC_HEAD and not self._continuing):
            self._finish_buffered()
            return
        if state in (_State.PARAMS, _State.PARAM_NAME, _State.VALUE):
            self._value = None
            self._break_call("text ended inside the call")
        self._buf = ""
        self._dropped.clear()
        self._end_block()
