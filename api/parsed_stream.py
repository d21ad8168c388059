"""One sample's engine outputs through its output parser (tool calls, reasoning): the
`ParsedDelta`s the Responses and Messages front-ends turn into their own shapes. The chat route
does the same in api/chat.py `ChoiceText`; this is that loop for a single choice, with the
finish reason resolved and the token counts kept."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from api.chat import OutputParser, ParserSettings
from api.errors import APIError
from api.generation import Outputs
from api.parsers.base import ParsedDelta, coalesce_tool_deltas
from api.protocol import ChatRequest


@dataclass
class Totals:
    """What one sample's outputs said in the end: counts, and why it stopped."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None  # resolved: stop | length | tool_calls | abort
    stop_reason: int | str | None = None  # the stop string or token that ended it, if any


def make_parser(parsers: ParserSettings, chat: ChatRequest, opens_reasoning: bool, streaming: bool) -> OutputParser | None:
    return parsers.make(chat, opens_reasoning, streaming=streaming)


async def parsed_deltas(outputs: Outputs, parser: OutputParser | None, totals: Totals) -> AsyncIterator[ParsedDelta]:
    """Each engine step's text as a ParsedDelta (empty ones skipped); `totals` is filled as the
    outputs arrive. An engine error raises APIError (a stream turns it into an error event)."""
    async with aclosing(outputs):
        async for _, out in outputs:
            if out.error is not None:
                raise APIError(500, f"generation failed: {out.error}", code="engine_error")
            totals.prompt_tokens = out.num_prompt_tokens
            totals.cached_tokens = max(totals.cached_tokens, out.num_cached_tokens)
            totals.output_tokens = out.num_output_tokens
            final = out.finish_reason is not None
            if parser is None:
                delta = ParsedDelta(content=out.text_delta)
            else:
                delta = parser.feed(out.text_delta)
                if final:
                    tail = parser.finish()
                    delta = ParsedDelta(
                        content=delta.content + tail.content,
                        reasoning=delta.reasoning + tail.reasoning,
                        tool_calls=coalesce_tool_deltas([*delta.tool_calls, *tail.tool_calls]),
                    )
            if final:
                reason = out.finish_reason
                totals.finish_reason = reason if parser is None else parser.finish_reason(reason)
                totals.stop_reason = out.stop_reason
            if not delta.is_empty:
                yield delta
    if totals.finish_reason is None:
        totals.finish_reason = "abort"
