"""Finding protocol tags (`<tool_call>`, `</think>`, `<parameter=` ...) in streamed text, and
how much of a text's tail might be the start of one and must be held back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TagSet:
    """The tags one parser state looks for. Every tag starts with `<` and has no other `<`,
    so only `<` positions need trying."""

    tags: tuple[str, ...]
    longest: int = field(init=False)

    def __post_init__(self) -> None:
        assert self.tags and all(t.startswith("<") and t.count("<") == 1 for t in self.tags), self.tags
        object.__setattr__(self, "longest", max(len(t) for t in self.tags))


def find_first_tag(text: str, tags: TagSet, start: int = 0) -> tuple[int, str] | None:
    """The earliest complete occurrence at or after `start` of any tag: (position, tag).
    One C-level `find` plus a few `startswith` per `<` in the text."""
    i = text.find("<", start)
    while i != -1:
        for tag in tags.tags:
            if text.startswith(tag, i):
                return i, tag
        i = text.find("<", i + 1)
    return None


def partial_tag_start(text: str, tags: TagSet, start: int = 0) -> int:
    """Where the text's longest tail that is a proper prefix of a tag begins (len(text) when
    no tail could grow into a tag). Only the last `longest - 1` characters are looked at, so
    this is O(1) in the length of `text`."""
    i = text.find("<", max(start, len(text) - tags.longest + 1))
    while i != -1:
        tail = text[i:]
        for tag in tags.tags:
            if len(tail) < len(tag) and tag.startswith(tail):
                return i
        i = text.find("<", i + 1)
    return len(text)
