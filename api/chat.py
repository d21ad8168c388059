"""/v1/chat/completions on top of the engine's outputs: the prompt from the checkpoint's chat
template, then either SSE chunks (one per engine output) or one JSON body.

Text deltas pass through an optional output parser (tool calls, reasoning; api/parsers/) in
exactly one place per path: `ChoiceText.delta` when streaming, `ChoiceText.message` when not.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from api.errors import APIError
from api.generation import Outputs
from api.protocol import ChatRequest
from api.responses import ResponseHeader, UsageCounter, chat_logprobs
from api.sse import DONE, encode_error_event, encode_event

logger = logging.getLogger("fp4serve.api")

CHUNK = "chat.completion.chunk"


class OutputParser(Protocol):
    """What api/parsers/ provides (`api.parsers.OutputParser`): one per choice."""

    def feed(self, text: str) -> Any: ...  # -> ParsedDelta(content, reasoning, tool_calls)

    def finish(self) -> Any: ...

    def finish_reason(self, engine_finish_reason: str) -> str: ...


@dataclass(frozen=True)
class ParserSettings:
    """The server's --tool-parser / --reasoning-parser, with `auto` already resolved."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None

    def make(self, request: ChatRequest, starts_in_reasoning: bool, streaming: bool | None = None) -> OutputParser | None:
        """`streaming`: defaults to the request's `stream`; False holds each tool call until its
        text closed (a call that never closed stays content)."""
        # Tool calls are parsed only when the client offered tools and did not turn them off.
        tool_parser = self.tool_parser if request.tools and request.tool_choice != "none" else None
        if tool_parser is None and self.reasoning_parser is None:
            return None
        from api.parsers import OutputParser as Parser  # lazily: an optional feature

        return Parser(
            tool_parser=tool_parser,
            reasoning_parser=self.reasoning_parser,
            tools=request.tools,
            starts_in_reasoning=starts_in_reasoning,
            parallel_tool_calls=request.parallel_tool_calls,
            streaming=request.stream.stream if streaming is None else streaming,
        )


class ChoiceText:
    """One choice's text on its way to the client, through the output parser if any."""

    def __init__(self, parser: OutputParser | None) -> None:
        self.parser = parser
        self._parsed: list[Any] = []  # non-streaming: ParsedDeltas, assembled at the end
        self._texts: list[str] = []

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The `delta` fields for the text one engine step produced."""
        if self.parser is None:
            return {"content": text} if text else {}
        parsed = self.parser.feed(text)
        if final:  # what the parser held back (a partial tag, an unclosed block) leaves now
            parsed = _joined(parsed, self.parser.finish())
        return _delta_fields(parsed)

    def add(self, text: str, final: bool) -> None:
        if self.parser is None:
            self._texts.append(text)
            return
        self._parsed.append(self.parser.feed(text))
        if final:
            self._parsed.append(self.parser.finish())

    def message(self) -> dict[str, Any]:
        if self.parser is None:
            return {"role": "assistant", "content": "".join(self._texts)}
        from api.parsers import assemble

        parsed = assemble(self._parsed)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
        return message

    def finish_reason(self, reason: str) -> str:
        # `tool_calls` only for a parsed call that was not cut off by max_tokens (anchors §5).
        return reason if self.parser is None else self.parser.finish_reason(reason)


def _joined(first: Any, then: Any) -> Any:
    """Two ParsedDeltas as one chunk's worth; one entry per tool-call index (older SDKs keep
    duplicates)."""
    from api.parsers.base import ParsedDelta, coalesce_tool_deltas

    return ParsedDelta(
        content=first.content + then.content,
        reasoning=first.reasoning + then.reasoning,
        tool_calls=coalesce_tool_deltas([*first.tool_calls, *then.tool_calls]),
    )


def _delta_fields(parsed: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if parsed.reasoning:
        fields["reasoning_content"] = parsed.reasoning
    if parsed.content:
        fields["content"] = parsed.content
    if parsed.tool_calls:
        # id, type and name once, in each call's first delta; then only arguments (anchors §5).
        fields["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
    return fields


@dataclass(frozen=True)
class ChatResponder:
    """Everything one chat response needs besides the engine's outputs."""

    header: ResponseHeader
    request: ChatRequest
    prompt_token_ids: list[int]
    parsers: ParserSettings
    starts_in_reasoning: bool

    def choices(self) -> list[ChoiceText]:
        n = self.request.params.n
        return [ChoiceText(self.parsers.make(self.request, self.starts_in_reasoning)) for _ in range(n)]

    async def stream(self, outputs: Outputs) -> AsyncIterator[bytes]:
        """SSE events: the role first, one chunk per engine output, usage, [DONE]."""
        req = self.request
        base = self.header.fields(CHUNK)
        if req.stream.include_usage:
            base["usage"] = None  # OpenAI sends usage: null on every chunk but the last
        choices = self.choices()
        usage = UsageCounter()
        for index in range(len(choices)):
            first: dict[str, Any] = {**base, "choices": [_choice(index, {"role": "assistant", "content": ""})]}
            if req.return_token_ids and index == 0:
                first["prompt_token_ids"] = self.prompt_token_ids
            yield encode_event(first)
        try:
            async with aclosing(outputs):
                async for _, out in outputs:
                    if out.error is not None:
                        yield encode_error_event(out.error)
                        break
                    usage.add(0, out.index, out)
                    choice = choices[out.index]
                    final = out.finish_reason is not None
                    delta = choice.delta(out.text_delta, final)
                    if not (delta or final or out.logprobs or req.return_token_ids):
                        continue  # e.g. a held-back stop-string prefix: nothing to say yet
                    entry = _choice(out.index, delta, choice.finish_reason(out.finish_reason) if final else None)
                    if out.logprobs is not None and req.top_logprobs is not None:
                        entry["logprobs"] = {"content": chat_logprobs(out.logprobs)}
                    if req.return_token_ids:
                        entry["token_ids"] = list(out.new_token_ids)
                    if final and out.stop_reason is not None:
                        entry["stop_reason"] = out.stop_reason
                    yield encode_event({**base, "choices": [entry]})
                else:
                    if req.stream.include_usage:
                        yield encode_event({**base, "choices": [], "usage": usage.usage()})
        except asyncio.CancelledError:
            raise
        except APIError as e:  # its deadline: --request-timeout, or a shutdown that stopped waiting
            yield encode_error_event(e.message, e.type, e.code)
        except Exception:
            # NOTE: the 200 is already sent; the error goes in-band and the trace to the log.
            logger.exception("chat stream %s failed", self.header.id)
            yield encode_error_event("generation failed; see the server log")
        yield DONE

    async def complete(self, outputs: Outputs) -> dict[str, Any]:
        """The whole response as one `chat.completion` body."""
        req = self.request
        choices = self.choices()
        usage = UsageCounter()
        finish: dict[int, Any] = {}
        token_ids: list[list[int]] = [[] for _ in choices]
        logprobs: list[list[dict[str, Any]]] = [[] for _ in choices]
        async with aclosing(outputs):
            async for _, out in outputs:
                if out.error is not None:
                    raise APIError(500, f"generation failed: {out.error}", code="engine_error")
                usage.add(0, out.index, out)
                final = out.finish_reason is not None
                choices[out.index].add(out.text_delta, final)
                token_ids[out.index].extend(out.new_token_ids)
                if out.logprobs is not None:
                    logprobs[out.index].extend(chat_logprobs(out.logprobs))
                if final:
                    finish[out.index] = (out.finish_reason, out.stop_reason)
        body_choices = []
        for index, choice in enumerate(choices):
            reason, stop_reason = finish.get(index, ("abort", None))
            entry: dict[str, Any] = {
                "index": index,
                "message": choice.message(),
                "logprobs": {"content": logprobs[index]} if req.top_logprobs is not None else None,
                "finish_reason": choice.finish_reason(reason),
                "stop_reason": stop_reason,
            }
            if req.return_token_ids:
                entry["token_ids"] = token_ids[index]
            body_choices.append(entry)
        body: dict[str, Any] = {**self.header.fields("chat.completion"), "choices": body_choices, "usage": usage.usage()}
        if req.return_token_ids:
            body["prompt_token_ids"] = self.prompt_token_ids
        return body


def _choice(index: int, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def prompt_closes_reasoning(prompt_tail: str) -> bool:
    """Whether the template already wrote a closed think block (enable_thinking=false): the
    output has none. `prompt_tail`: the prompt's last tokens as text (InputProcessor.prompt_tail)."""
    return prompt_tail.rstrip().endswith("</think>")


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether the template left a `<think>` block open, so the output starts as reasoning."""
    return prompt_tail.rstrip().endswith("<think>")
