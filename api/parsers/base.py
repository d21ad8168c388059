"""What the output parsers hand the API layer: streaming deltas, the whole-text result, the
Protocols a reasoning or tool-call parser implements, and the typed error for a bad name."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

CALL_ID_PREFIX = "call_"

# Makes a fresh tool-call id; injected so that a debugging run can use stable ids.
CallIdFactory = Callable[[], str]


def new_call_id() -> str:
    """An OpenAI-style tool-call id: `call_` + 24 lowercase hex digits."""
    return CALL_ID_PREFIX + secrets.token_hex(12)


class UnknownParserError(ValueError):
    """A parser name given on the command line that no parser answers to."""

    def __init__(self, kind: str, name: str, choices: tuple[str, ...]) -> None:
        super().__init__(f"unknown {kind} parser {name!r}; choose one of: {', '.join(choices)}")
        self.kind = kind
        self.name = name
        self.choices = choices


@dataclass(frozen=True)
class ToolCallDelta:
    """One fragment of tool call `index`, shaped for the OpenAI SDK's `accumulate_delta`.

    The call's first fragment carries `id` and `name` (and `type: "function"` on the wire);
    every later one carries only `index` and an `arguments` piece. The pieces of one call
    concatenate to a JSON object.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def __post_init__(self) -> None:
        assert self.index >= 0, self.index
        assert (self.id is None) == (self.name is None), "id and name travel together"

    @property
    def is_header(self) -> bool:
        return self.id is not None

    def to_openai(self) -> dict:
        """The `choices[].delta.tool_calls[]` entry of a chat.completion.chunk."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedDelta:
    """What one `feed` (or `finish`) adds to the answer. At most one `ToolCallDelta` per index,
    in index order."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.content or self.reasoning or self.tool_calls)


EMPTY_DELTA = ParsedDelta()


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str  # a JSON object as text, exactly as streamed

    def to_openai(self) -> dict:
        """The `choices[].message.tool_calls[]` entry of a chat.completion."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments_json},
        }


@dataclass(frozen=True)
class ParsedOutput:
    """The whole answer: None where a part is empty, as OpenAI sends `content: null`."""

    content: str | None
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]


class ReasoningParser(Protocol):
    """Splits raw model text into `reasoning` and `content` (no tool calls)."""

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


class ToolParser(Protocol):
    """Splits content into `content` and tool-call deltas (no reasoning)."""

    problems: list[str]  # why text did not become a call, for `parse-output` and logs
    broken_calls: list[int]  # streaming: indices of announced calls whose text never closed

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...

    @property
    def num_calls(self) -> int: ...

    @property
    def num_complete_calls(self) -> int: ...  # calls whose text closed


def coalesce_tool_deltas(deltas: list[ToolCallDelta]) -> tuple[ToolCallDelta, ...]:
    """Merge consecutive fragments of the same call into one, and drop empty ones.

    NOTE: one chunk must not list the same index twice: older `accumulate_delta` versions
    store the first list they see verbatim and would keep both entries.
    """
    merged: list[ToolCallDelta] = []
    for d in deltas:
        if merged and merged[-1].index == d.index:
            last = merged[-1]
            assert not d.is_header, "a call's header is its first fragment"
            merged[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + d.arguments)
        elif d.is_header or d.arguments:
            assert not merged or merged[-1].index < d.index, "calls stream in index order"
            merged.append(d)
    return tuple(merged)
