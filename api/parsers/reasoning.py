"""`--reasoning-parser qwen3`: routes `<think>...</think>` text to `reasoning` and the rest to
`content`, streamed, never letting a think tag (or a piece of one) into either.

Rules (each a pure function of the whole text, however it is split):
- `starts_in_reasoning`: the prompt ended inside an open think block (the template wrote
  `<think>`), so the output starts as reasoning. With enable_thinking=false the template
  closes the block in the prompt: pass False and everything is content.
- `<think>` switches to reasoning, `</think>` to content; the tags themselves are dropped
  (a `<think>` the model repeats at the start, or a stray `</think>` in content, vanishes).
  If `</think>` never arrives, all text after `<think>` is reasoning.
- Each reasoning span is stripped of surrounding whitespace, whitespace before `<think>` and
  after `</think>` is dropped, so `<think>\\nplan\\n</think>\\n\\nAnswer` gives
  reasoning "plan" and content "Answer". Other whitespace is kept.
- Held back while streaming: a tail that may start a tag (`</thi`) and trailing whitespace
  (it is dropped if a tag follows). `finish()` flushes content's held text as content;
  a reasoning span's trailing whitespace is dropped.
"""

from __future__ import annotations

from api.parsers.base import EMPTY_DELTA, ParsedDelta
from api.parsers.tags import TagSet, find_first_tag, partial_tag_start

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_TAGS = TagSet((THINK_OPEN, THINK_CLOSE))


class Qwen3ReasoningParser:
    """Incremental `<think>` splitter: O(len(text)) per feed, holds at most a partial tag plus
    a run of whitespace."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._in_reasoning = starts_in_reasoning
        self._pending = ""  # unscanned tail: a possible partial tag
        self._held_ws = ""  # trailing whitespace of the current span, not yet emitted
        self._strip_left = starts_in_reasoning  # drop whitespace at the start of this span
        self._reasoning: list[str] = []
        self._content: list[str] = []

    @property
    def in_reasoning(self) -> bool:
        return self._in_reasoning

    def feed(self, text: str) -> ParsedDelta:
        buf = self._pending + text
        pos = 0
        while (found := find_first_tag(buf, _TAGS, pos)) is not None:
            i, tag = found
            self._emit(buf[pos:i])
            self._switch(tag)
            pos = i + len(tag)
        cut = partial_tag_start(buf, _TAGS, pos)
        self._emit(buf[pos:cut])
        self._pending = buf[cut:]
        return self._take()

    def finish(self) -> ParsedDelta:
        # A partial tag at the very end never became a tag: it is text.
        self._emit(self._pending)
        self._pending = ""
        if not self._in_reasoning:
            self._content.append(self._held_ws)
        self._held_ws = ""
        return self._take()

    def _emit(self, text: str) -> None:
        if self._strip_left:
            text = text.lstrip()
            if not text:
                return
            self._strip_left = False
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body) :]
        if body:
            (self._reasoning if self._in_reasoning else self._content).append(body)

    def _switch(self, tag: str) -> None:
        if tag == THINK_OPEN and self._in_reasoning:
            return  # a repeated opening tag inside reasoning: drop only the tag
        # Whitespace that touches a think tag belongs to neither side.
        self._held_ws = ""
        self._strip_left = True
        self._in_reasoning = tag == THINK_OPEN

    def _take(self) -> ParsedDelta:
        if not self._reasoning and not self._content:
            return EMPTY_DELTA
        delta = ParsedDelta(content="".join(self._content), reasoning="".join(self._reasoning))
        self._reasoning.clear()
        self._content.clear()
        return delta
