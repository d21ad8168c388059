"""Re-emits one JSON object (a hermes tool call's `arguments`) as it streams in, so that
every prefix of what it emits can be closed into valid JSON and string values flow out
character by character.

What it emits is the same data in canonical form (`", "` and `": "` separators, no other
whitespace, raw control characters in strings escaped, escapes otherwise kept verbatim). A key,
`:` and `,` are held until the next value starts, and a number or literal until it ends, so
what has been emitted is always "inside a string value" or "just after a value or an opening
bracket". `close()` then completes it with at most a `"` and the open brackets: this is how a
truncated or broken object still yields valid JSON.
"""

from __future__ import annotations

import enum
import json
import re

_WS_RUN = re.compile(r"[ \t\n\r]+")
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_SCALAR_RUN = re.compile(r"[0-9A-Za-z+\-.]+")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = frozenset({"true", "false", "null"})
_SCALAR_START = frozenset("-0123456789tfn")
_SIMPLE_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")


class _Mode(enum.Enum):
    KEY_OR_END = "key or }"  # just after {
    KEY = "key"  # after , in an object
    IN_KEY = "in key"
    COLON = ":"
    VALUE_OR_END = "value or ]"  # just after [
    VALUE = "value"  # after : or after , in an array
    IN_STRING = "in string"
    IN_SCALAR = "in number or literal"
    AFTER_VALUE = ", or closing bracket"
    DONE = "done"


class JsonObjectStream:
    """Incremental canonicalizer for one JSON object whose opening `{` was already read
    (and counts as emitted). O(len(text)) per feed; holds at most one key, one scalar and one
    partial escape sequence."""

    def __init__(self) -> None:
        self._stack: list[str] = ["}"]  # closers of the open containers, innermost last
        self._mode = _Mode.KEY_OR_END
        self._pending = ""  # separator and key, emitted with the next value's first char
        self._key: list[str] = []
        self._scalar = ""
        self._escape = ""  # a partial escape sequence cut by the end of the last feed
        self.failed = False
        self.error: str | None = None
        self.end: int | None = None  # where in the last fed text it stopped (done or failed)

    @property
    def done(self) -> bool:
        return self._mode is _Mode.DONE

    @property
    def stopped(self) -> bool:
        return self.done or self.failed

    def feed(self, text: str) -> str:
        """Consume `text` up to the object's closing brace or its first invalid character
        (then `stopped` is True and `end` says where); return the canonical JSON it adds."""
        assert not self.stopped, "feed after the object ended"
        offset = len(self._escape)
        text = self._escape + text
        self._escape = ""
        out: list[str] = []
        pos, n = 0, len(text)
        while pos < n:
            mode = self._mode
            if mode is _Mode.IN_STRING or mode is _Mode.IN_KEY:
                sink = out if mode is _Mode.IN_STRING else self._key
                m = _STRING_RUN.match(text, pos)
                if m is not None:
                    sink.append(m.group())
                    pos = m.end()
                    continue
                ch = text[pos]
                if ch == '"':
                    pos += 1
                    if mode is _Mode.IN_STRING:
                        out.append('"')
                        self._mode = _Mode.AFTER_VALUE
                    else:
                        self._pending += '"' + "".join(self._key) + '"'
                        self._key.clear()
                        self._mode = _Mode.COLON
                elif ch == "\\":
                    seq = self._escape_at(text, pos)
                    if seq is None:
                        return self._fail(out, text, pos, offset, "invalid escape")
                    if seq == "":
                        self._escape = text[pos:]  # incomplete: finish it next feed
                        break
                    sink.append(seq)
                    pos += len(seq)
                else:  # a raw control character: invalid JSON, but its meaning is clear
                    sink.append(json.dumps(ch)[1:-1])
                    pos += 1
                continue
            if mode is _Mode.IN_SCALAR:
                m = _SCALAR_RUN.match(text, pos)
                if m is not None:
                    self._scalar += m.group()
                    pos = m.end()
                    continue
                if not self._scalar_is_valid():
                    return self._fail(out, text, pos, offset, f"invalid value {self._scalar!r}")
                out.append(self._pending + self._scalar)
                self._pending = self._scalar = ""
                self._mode = _Mode.AFTER_VALUE
                continue
            m = _WS_RUN.match(text, pos)
            if m is not None:
                pos = m.end()
                continue
            ch = text[pos]
            if mode is _Mode.KEY_OR_END or mode is _Mode.KEY:
                if ch == '"':
                    self._mode = _Mode.IN_KEY
                elif not (ch == "}" and mode is _Mode.KEY_OR_END):
                    return self._fail(out, text, pos, offset, f"expected {mode.value}")
            elif mode is _Mode.COLON:
                if ch != ":":
                    return self._fail(out, text, pos, offset, "expected :")
                self._pending += ": "
                self._mode = _Mode.VALUE
            elif mode is _Mode.VALUE or mode is _Mode.VALUE_OR_END:
                if ch in '"{[':
                    out.append(self._pending + ch)
                    self._pending = ""
                    if ch == '"':
                        self._mode = _Mode.IN_STRING
                    else:
                        self._stack.append("}" if ch == "{" else "]")
                        self._mode = _Mode.KEY_OR_END if ch == "{" else _Mode.VALUE_OR_END
                elif ch in _SCALAR_START:
                    self._mode = _Mode.IN_SCALAR
                    continue  # the scalar run is read in that mode
                elif not (ch == "]" and mode is _Mode.VALUE_OR_END):
                    return self._fail(out, text, pos, offset, f"expected {mode.value}")
            elif mode is _Mode.AFTER_VALUE:
                if ch == ",":
                    self._pending = ", "
                    self._mode = _Mode.KEY if self._stack[-1] == "}" else _Mode.VALUE
                elif ch != self._stack[-1]:
                    return self._fail(out, text, pos, offset, f"expected {mode.value}")
            if ch in "}]" and self._mode is not _Mode.IN_STRING:
                out.append(ch)
                self._stack.pop()
                if not self._stack:
                    self._mode = _Mode.DONE
                    self.end = pos + 1 - offset
                    return "".join(out)
                self._mode = _Mode.AFTER_VALUE
            pos += 1
        return "".join(out)

    def close(self) -> str:
        """The text that completes what was emitted into a valid JSON object (empty once the
        object ended on its own). A held scalar is kept if valid; a held key is dropped."""
        if self.done:
            return ""
        parts: list[str] = []
        if self._mode is _Mode.IN_SCALAR and self._scalar_is_valid():
            parts.append(self._pending + self._scalar)
        elif self._mode is _Mode.IN_STRING:
            parts.append('"')
        parts.extend(reversed(self._stack))
        self._stack.clear()
        self._mode = _Mode.DONE
        return "".join(parts)

    def _fail(self, out: list[str], text: str, pos: int, offset: int, why: str) -> str:
        self.failed = True
        self.error = f"{why} at {text[pos : pos + 12]!r}"
        self.end = max(0, pos - offset)  # a bad escape may have begun in the previous feed
        return "".join(out)

    def _scalar_is_valid(self) -> bool:
        s = self._scalar
        return s in _LITERALS or _NUMBER.fullmatch(s) is not None

    @staticmethod
    def _escape_at(text: str, pos: int) -> str | None:
        """The escape sequence at `pos` (a backslash); "" if the text ends inside it, None if
        it is not a JSON escape."""
        if pos + 1 >= len(text):
            return ""
        kind = text[pos + 1]
        if kind in _SIMPLE_ESCAPES:
            return text[pos : pos + 2]
        if kind != "u":
            return None
        seq = text[pos : pos + 6]
        if not all(c in _HEX for c in seq[2:]):
            return None
        return seq if len(seq) == 6 else ""
