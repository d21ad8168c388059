"""One Qwen3-Coder `<parameter=...>` value on its way into the call's arguments JSON: a string
value streams as escaped characters while it arrives; any other type is converted from the
whole raw text at the parameter's end. Each value emits its own `"key": ` prefix."""

from __future__ import annotations

import json
import re

from api.parsers.schema_types import NULL_WORDS, ParamType, convert_value

# What json.dumps(ensure_ascii=False) escapes; most streamed pieces contain none of it.
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f]')


def _escaped(text: str) -> str:
    # JSON escaping is per character, so escaping pieces and joining them equals escaping
    # the whole.
    if _NEEDS_ESCAPE.search(text) is None:
        return text
    return json.dumps(text, ensure_ascii=False)[1:-1]


class StringValue:
    """Streams `"key": "...` as characters arrive. Held back: one trailing newline (it is
    stripped if the value ends there) and, for a schema that allows null, a value that may
    still turn out to be `null`/`None`. The key and opening quote go out with the first
    character, so an empty value becomes `""` and a null one `null`."""

    def __init__(self, key_prefix: str, nullable: bool) -> None:
        self._key_prefix = key_prefix
        self._nullable = nullable
        self._first = True  # no character seen: a leading newline is stripped
        self._started = False  # key and opening quote emitted
        self._held = ""

    def feed(self, text: str) -> str:
        text = self._strip_leading(text)
        text = self._held + text
        self._held = "\n" if text.endswith("\n") else ""
        if self._held:
            text = text[:-1]
        if not self._started:
            if not text or (self._nullable and any(w.startswith(text) for w in NULL_WORDS)):
                self._held = text + self._held
                return ""
            self._started = True
            return self._key_prefix + '"' + _escaped(text)
        return _escaped(text)

    def end(self, text: str) -> str:
        text = self._held + self._strip_leading(text)
        self._held = ""
        if text.endswith("\n"):
            text = text[:-1]
        if self._started:
            return _escaped(text) + '"'
        if self._nullable and text in NULL_WORDS:
            return self._key_prefix + "null"
        return self._key_prefix + json.dumps(text, ensure_ascii=False)

    def _strip_leading(self, text: str) -> str:
        if self._first and text:
            self._first = False
            if text[0] == "\n":
                return text[1:]
        return text


class ConvertedValue:
    """Collects a non-string value's raw text and emits `"key": <json>` at its end."""

    def __init__(self, key_prefix: str, ptype: ParamType) -> None:
        assert not ptype.is_string, "strings stream through StringValue"
        self._key_prefix = key_prefix
        self._ptype = ptype
        self._parts: list[str] = []

    def feed(self, text: str) -> str:
        self._parts.append(text)
        return ""

    def end(self, text: str) -> str:
        raw = "".join(self._parts) + text
        self._parts.clear()
        raw = raw.removeprefix("\n").removesuffix("\n")
        value = convert_value(raw, self._ptype)
        return self._key_prefix + json.dumps(value, ensure_ascii=False)
