"""What both Qwen tool-call formats share: scanning content for `<tool_call>`, trimming the
whitespace around blocks, numbering calls and giving them ids, and returning a block that does
not form a call to the content verbatim. A format subclass reads the inside of a block.

Whitespace that touches a block that becomes a call (before its opening tag, after its
closing tag) is dropped, so `Let me look.\\n\\n<tool_call>...</tool_call>\\n` gives content
"Let me look." and a call; a block returned as content keeps it. Content's trailing
whitespace is held back while streaming until something other than a block follows.

No invented calls: a call counts only once its text closed (`</tool_call>`; Qwen3-Coder:
`</function>`). A call that never closed, cut by max_tokens or malformed, is *broken*:
- streaming (`streaming=True`): the deltas already sent stay, nothing more is sent for it
  (no closing quote or brace the model did not write), and it does not count in
  `num_complete_calls`;
- whole (`streaming=False`, the non-streamed reply): a call's deltas are held until it closes;
  a broken one is withdrawn and its block's text, tags and all, becomes content verbatim.
"""

from __future__ import annotations

from api.parsers.base import CallIdFactory, ParsedDelta, ToolCallDelta, coalesce_tool_deltas
from api.parsers.tags import TagSet, find_first_tag, partial_tag_start

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_OPEN_TAGS = TagSet((TOOL_CALL_OPEN,))
_CLOSE_TAGS = TagSet((TOOL_CALL_CLOSE,))


def tool_schemas(tools: list[dict] | None) -> dict[str, dict] | None:
    """Function name -> its `parameters` JSON schema, from an OpenAI `tools` list. None when no
    function is listed: then any name is accepted."""
    schemas: dict[str, dict] = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            schemas[function["name"]] = parameters if isinstance(parameters, dict) else {}
    return schemas or None


class ToolStream:
    """Base of the streaming tool parsers. Subclasses implement `_begin_block`,
    `_step_block` (consume what they can of `self._buf`; True if worth calling again) and
    `_finish_block` (the text ended inside a block)."""

    def __init__(self, tools: list[dict] | None, new_call_id: CallIdFactory, streaming: bool = True) -> None:
        self._schemas = tool_schemas(tools)
        self._streaming = streaming
        self._text: list[str] = []  # whole mode: all text fed, to return a broken block verbatim
        self._fed = 0  # characters fed so far
        self._raw_start = 0  # where the current block's uncommitted text starts
        self._pending: list[ToolCallDelta] = []  # whole mode: the open call's deltas
        self._call_open = False  # a call was announced and has not closed yet
        self._broken = False  # the open call can no longer close
        self._num_broken = 0
        self.broken_calls: list[int] = []  # streaming: indices of announced calls that never closed
        self._new_call_id = new_call_id
        self.problems: list[str] = []
        self._buf = ""  # text not consumed yet: at most a partial tag, except where noted
        self._in_block = False
        self._strip_left = False  # drop leading whitespace of the content that follows
        self._stripped_ws = ""  # what _strip_left dropped, in case a failed block follows
        self._content_ws = ""  # trailing whitespace of content, held
        self._lead_ws = ""  # whitespace dropped before the current block's opening tag
        self._raw: list[str] = []  # the current block's text while it may still fail
        self._num_blocks = 0
        self._num_calls = 0
        self._out_content: list[str] = []
        self._out_calls: list[ToolCallDelta] = []

    @property
    def num_calls(self) -> int:
        return self._num_calls

    @property
    def num_complete_calls(self) -> int:
        """Calls whose text closed (whole mode withdraws the others, streaming keeps their index)."""
        return self._num_calls - self._num_broken - self._call_open

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        self._fed += len(text)
        if not self._streaming:
            self._text.append(text)
        while self._step_block() if self._in_block else self._step_content():
            pass
        return self._take()

    def finish(self) -> ParsedDelta:
        if self._in_block:
            self._finish_block()
            assert not self._in_block, "a finished block goes back to content"
        self._emit_content(self._buf)  # a partial `<tool_c` at the very end is plain text
        self._buf = ""
        self._out_content.append(self._content_ws)
        self._content_ws = ""
        return self._take()

    # ---- for subclasses -------------------------------------------------------------------

    def _begin_block(self) -> None:
        raise NotImplementedError

    def _step_block(self) -> bool:
        raise NotImplementedError

    def _finish_block(self) -> None:
        raise NotImplementedError

    def _known(self, name: str) -> bool:
        return bool(name) and (self._schemas is None or name in self._schemas)

    def _parameters_schema(self, name: str) -> dict | None:
        return None if self._schemas is None else self._schemas.get(name)

    def _announce(self, name: str, arguments: str) -> None:
        """Start call number `num_calls`: its id, name and first arguments fragment."""
        self._calls_out().append(ToolCallDelta(self._num_calls, self._new_call_id(), name, arguments))
        self._num_calls += 1
        self._call_open = True
        self._broken = False
        self._raw.clear()  # a streamed call never goes back to content

    def _emit_arguments(self, text: str) -> None:
        assert self._num_calls > 0, "arguments before any call was announced"
        if text and not self._broken:
            self._calls_out().append(ToolCallDelta(self._num_calls - 1, arguments=text))

    def _calls_out(self) -> list[ToolCallDelta]:
        return self._out_calls if self._streaming else self._pending

    def _pos(self) -> int:
        """Where in the fed text the unconsumed `_buf` starts."""
        return self._fed - len(self._buf)

    def _break_call(self, why: str) -> None:
        """The open call cannot close: nothing more is sent for it (see the module doc)."""
        if not self._broken:
            self.problems.append(f"tool call {self._num_calls - 1}: {why}; not a call")
            self._broken = True

    def _commit_call(self) -> bool:
        """The open call's text closed (or, when broken, its block ended): a whole-mode call is
        released, or withdrawn with its text going to content (then True)."""
        withdrawn = False
        if self._call_open and self._broken:
            if self._streaming:
                self._num_broken += 1
                self.broken_calls.append(self._num_calls - 1)
            else:
                self._pending.clear()
                self._num_calls -= 1
                raw = "".join(self._text)[self._raw_start : self._pos()]
                self._strip_left = False
                self._emit_content(self._lead_ws + raw)
                withdrawn = True
        self._call_open = self._broken = False
        self._out_calls.extend(self._pending)
        self._pending.clear()
        self._raw_start = self._pos()
        self._lead_ws = ""
        return withdrawn

    def _end_block(self) -> None:
        """The block's closing tag was read (or the text ended): back to content."""
        withdrawn = self._commit_call()
        self._in_block = False
        self._strip_left = not withdrawn

    def _fail_block(self, why: str, closed: bool) -> None:
        """The block does not form a call: its text, tags and all, becomes content."""
        self.problems.append(f"tool_call block {self._num_blocks - 1}: {why}; kept as content")
        text = self._lead_ws + TOOL_CALL_OPEN + "".join(self._raw)
        self._raw.clear()
        self._in_block = False
        self._strip_left = False
        self._emit_content(text + TOOL_CALL_CLOSE if closed else text)

    def _close_buffered(self, inner: str, closed: bool) -> None:
        """A block read whole (see `_step_buffered`) ended: a format may still make a call of
        `inner`; by default it is not one."""
        self._fail_block("not a tool call", closed)

    def _step_buffered(self) -> bool:
        """Collect the block's text up to `</tool_call>`, then hand it to `_close_buffered`."""
        found = find_first_tag(self._buf, _CLOSE_TAGS)
        if found is None:
            cut = partial_tag_start(self._buf, _CLOSE_TAGS)
            self._raw.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        i, tag = found
        self._raw.append(self._buf[:i])
        self._buf = self._buf[i + len(tag) :]
        self._close_buffered("".join(self._raw), closed=True)
        return True

    def _finish_buffered(self) -> None:
        self._raw.append(self._buf)
        self._buf = ""
        self._close_buffered("".join(self._raw), closed=False)

    # ---- content ----------------------------------------------------------------------------

    def _step_content(self) -> bool:
        found = find_first_tag(self._buf, _OPEN_TAGS)
        if found is None:
            cut = partial_tag_start(self._buf, _OPEN_TAGS)
            self._emit_content(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        i, tag = found
        self._emit_content(self._buf[:i])
        self._raw_start = self._pos() + i
        self._buf = self._buf[i + len(tag) :]
        self._lead_ws = self._stripped_ws + self._content_ws
        self._stripped_ws = self._content_ws = ""
        self._in_block = True
        self._num_blocks += 1
        self._raw.clear()
        self._begin_block()
        return True

    def _emit_content(self, text: str) -> None:
        if self._strip_left:
            body = text.lstrip()
            if not body:
                self._stripped_ws += text
                return
            text = body
            self._strip_left = False
            self._stripped_ws = ""
        text = self._content_ws + text
        body = text.rstrip()
        self._content_ws = text[len(body) :]
        if body:
            self._out_content.append(body)

    def _take(self) -> ParsedDelta:
        if not self._out_content and not self._out_calls:
            return ParsedDelta()
        delta = ParsedDelta(content="".join(self._out_content), tool_calls=coalesce_tool_deltas(self._out_calls))
        self._out_content.clear()
        self._out_calls.clear()
        return delta
