"""`OutputParser`: one request's reasoning parser and tool parser chained over its streamed
text (reasoning first; tool calls are read only from content), plus `assemble` (deltas ->
whole answer, exactly as the OpenAI SDK accumulates a stream), the finish-reason rule, and
`ParserSettings` (the server's parser flags: which parser one choice of one request gets).

The non-streaming path is the streaming one run to the end (`parse_text`), so both paths
give the same answer by construction.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from api.parsers.base import (
    EMPTY_DELTA,
    CallIdFactory,
    ParsedDelta,
    ParsedOutput,
    ReasoningParser,
    ToolCall,
    ToolParser,
    coalesce_tool_deltas,
    new_call_id,
)
from api.parsers.factory import make_reasoning_parser, make_tool_parser


class OutputParser:
    """Splits one sample's generated text into content, reasoning and tool-call deltas.

    `tool_parser` / `reasoning_parser`: a name (see `api.parsers`) or None for none; resolve
    "auto" first with `choose_tool_parser`. `tools`: the request's OpenAI `tools` list; when
    it names functions, calls to other names stay content. `starts_in_reasoning`: the prompt
    ends inside an open `<think>` block. `parallel_tool_calls=False` keeps only the first
    call; later ones are parsed and dropped (they do not become content). `streaming=False`
    (a whole reply): a call is released only once its text closed, and one that never closed
    stays content; streaming, such a call gets nothing more and no `tool_calls` finish.
    `forced` (a tool_calls grammar binds the output: tool_choice required or named): the output
    is calls only, so a call cut by max_tokens is kept as it was streamed, arguments so far and
    `broken_calls` naming it, in whole replies too, and no text ever becomes content (what is
    not a call yet is the template's markup of one being written).
    """

    def __init__(
        self,
        tool_parser: str | None,
        reasoning_parser: str | None,
        tools: list[dict] | None,
        starts_in_reasoning: bool,
        parallel_tool_calls: bool = True,
        *,
        call_id_factory: CallIdFactory = new_call_id,
        streaming: bool = True,
        forced: bool = False,
    ) -> None:
        self._reasoning: ReasoningParser | None = (
            make_reasoning_parser(reasoning_parser, starts_in_reasoning) if reasoning_parser else None
        )
        self._tools: ToolParser | None = (
            make_tool_parser(tool_parser, tools, call_id_factory, streaming=streaming or forced)
            if tool_parser
            else None
        )
        self._forced = forced and self._tools is not None
        self._parallel_tool_calls = parallel_tool_calls
        self._finished = False

    @property
    def tool_calls_made(self) -> bool:
        """Whether at least one tool call was made whose text closed."""
        return self._tools is not None and self._tools.num_complete_calls > 0

    @property
    def broken_calls(self) -> tuple[int, ...]:
        """Streaming: the indices of announced calls whose text never closed (not calls)."""
        return tuple(self._tools.broken_calls) if self._tools is not None else ()

    @property
    def problems(self) -> tuple[str, ...]:
        """Why some text did not become a tool call, for logs and `parse-output`."""
        return tuple(self._tools.problems) if self._tools is not None else ()

    def feed(self, text: str) -> ParsedDelta:
        assert not self._finished, "feed after finish"
        if self._reasoning is None:
            return self._route(ParsedDelta(content=text), final=False)
        return self._route(self._reasoning.feed(text), final=False)

    def finish(self) -> ParsedDelta:
        """Flush what was held back (partial tags, whitespace, an unclosed block)."""
        assert not self._finished, "finish twice"
        self._finished = True
        split = self._reasoning.finish() if self._reasoning is not None else EMPTY_DELTA
        return self._route(split, final=True)

    def finish_reason(self, engine_finish_reason: str) -> str:
        return resolve_finish_reason(engine_finish_reason, self.tool_calls_made)

    def _route(self, split: ParsedDelta, final: bool) -> ParsedDelta:
        if self._tools is None:
            return split
        parsed = self._tools.feed(split.content) if split.content else EMPTY_DELTA
        content, calls = parsed.content, parsed.tool_calls
        if final:
            tail = self._tools.finish()
            content += tail.content
            calls = coalesce_tool_deltas([*calls, *tail.tool_calls])
        if self._forced:
            content = ""
        if not self._parallel_tool_calls:
            calls = tuple(c for c in calls if c.index == 0)
        if not (content or split.reasoning or calls):
            return EMPTY_DELTA
        return ParsedDelta(content=content, reasoning=split.reasoning, tool_calls=calls)


@dataclass(frozen=True)
class ParserSettings:
    """The server's --tool-parser / --reasoning-parser, with `auto` already resolved."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None

    def make(
        self,
        tools: list[dict[str, Any]] | None,
        tool_choice: Any,
        parallel_tool_calls: bool,
        starts_in_reasoning: bool,
        streaming: bool,
        forced: bool = False,
    ) -> OutputParser | None:
        """One choice's parser; None when the output is plain text. Tool calls are parsed only
        when the client offered tools and did not turn them off. `forced`: a tool_calls grammar
        binds the output (OutputParser says what changes)."""
        tool_parser = self.tool_parser if tools and tool_choice != "none" else None
        if tool_parser is None and self.reasoning_parser is None:
            return None
        return OutputParser(
            tool_parser,
            self.reasoning_parser,
            tools,
            starts_in_reasoning,
            parallel_tool_calls,
            streaming=streaming,
            forced=forced,
        )


def resolve_finish_reason(engine_finish_reason: str, tool_calls_made: bool) -> str:
    """`tool_calls` only when a call was made and generation stopped on its own; a `length`
    cut (or an abort) is reported as such even mid-call (vllm#53269)."""
    if tool_calls_made and engine_finish_reason == "stop":
        return "tool_calls"
    return engine_finish_reason


def assemble(deltas: Iterable[ParsedDelta]) -> ParsedOutput:
    """The whole answer from a stream of deltas, merged the way the OpenAI SDK's
    `accumulate_delta` does: strings concatenate, tool-call fragments join by index."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, str]] = []
    for delta in deltas:
        content.append(delta.content)
        reasoning.append(delta.reasoning)
        for d in delta.tool_calls:
            if d.index == len(calls):
                calls.append({"id": "", "name": "", "arguments": ""})
            assert d.index < len(calls), f"tool call index {d.index} skips an index"
            call = calls[d.index]
            call["id"] += d.id or ""
            call["name"] += d.name or ""
            call["arguments"] += d.arguments
    return ParsedOutput(
        content="".join(content) or None,
        reasoning="".join(reasoning) or None,
        tool_calls=tuple(ToolCall(c["id"], c["name"], c["arguments"]) for c in calls),
    )


def parse_text(
    text: str,
    tool_parser: str | None,
    reasoning_parser: str | None,
    tools: list[dict] | None,
    starts_in_reasoning: bool,
    parallel_tool_calls: bool = True,
    *,
    call_id_factory: CallIdFactory = new_call_id,
) -> ParsedOutput:
    """Non-streaming: the whole text through the streaming parser, then `assemble`."""
    parser = OutputParser(
        tool_parser,
        reasoning_parser,
        tools,
        starts_in_reasoning,
        parallel_tool_calls,
        call_id_factory=call_id_factory,
        streaming=False,
    )
    return assemble([parser.feed(text), parser.finish()])
