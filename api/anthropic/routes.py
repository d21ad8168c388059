"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API as a mapping onto the
chat pipeline (api/pipeline.py; the mapping is api/anthropic/request.py). Its Encoder turns
parsed deltas into content blocks — `thinking`, `text`, `tool_use` — and, streaming, Anthropic's
events:

    message_start, ping,
    per block: content_block_start, content_block_delta* (thinking_delta, text_delta,
               input_json_delta), content_block_stop,
    message_delta (stop_reason, usage), message_stop.

Errors keep Anthropic's shape: `MESSAGES_ERROR_SHAPE` declares it for these paths, once, and every
layer that answers an error re-shapes it (api/error_shape.py, api/anthropic_errors.py); in a
stream they are an `error` event."""

from __future__ import annotations

import json
import secrets
from typing import Any

import orjson
import pydantic_core
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api.anthropic.request import MessagesRequestModel
from api.anthropic_errors import anthropic_error_body, to_anthropic
from api.context_errors import MESSAGES, refusals
from api.error_shape import ShapedPath
from api.errors import APIError, bad_request
from api.http import json_response, read_json, server_state
from api.parsers.base import ParsedDelta
from api.pipeline import ChoiceDelta, Started, Totals, check_model, render_chat, respond, start_chat
from api.request.validation import validate

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "abort": "end_turn"}


class ContentBlocks:
    """Builds the content blocks from deltas; `events` collects the stream events."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._open: dict[str, Any] | None = None
        self._arguments: list[str] = []  # the open tool_use block's JSON text
        self._open_call = -1

    def add(self, delta: ParsedDelta) -> None:
        if delta.reasoning:
            if self._open is None or self._open["type"] != "thinking":
                self._start({"type": "thinking", "thinking": "", "signature": ""})
            self._open["thinking"] += delta.reasoning
            self._delta({"type": "thinking_delta", "thinking": delta.reasoning})
        if delta.content:
            if self._open is None or self._open["type"] != "text":
                self._start({"type": "text", "text": ""})
            self._open["text"] += delta.content
            self._delta({"type": "text_delta", "text": delta.content})
        for call in delta.tool_calls:
            if call.is_header:
                self._start(
                    {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name, "input": {}}
                )
                self._open_call = call.index
            if call.arguments and call.index == self._open_call:
                self._arguments.append(call.arguments)
                self._delta({"type": "input_json_delta", "partial_json": call.arguments})

    def close(self) -> None:
        block = self._open
        if block is None:
            return
        self._open = None
        if block["type"] == "tool_use":
            block["input"] = tool_input("".join(self._arguments))
            self._arguments.clear()
        self.events.append(("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1}))

    def _start(self, block: dict[str, Any]) -> None:
        self.close()
        self.blocks.append(block)
        self._open = block
        shown = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        self.events.append(
            (
                "content_block_start",
                {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": shown},
            )
        )

    def _delta(self, delta: dict[str, Any]) -> None:
        self.events.append(
            ("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})
        )


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool_use block's `input` from its JSON text. A call cut by max_tokens keeps the
    arguments it had (pydantic-core's partial mode closes what was open, a string cut short
    included), as its streamed input_json_delta events showed them."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        try:
            value = pydantic_core.from_json(arguments, allow_partial="trailing-strings")
        except ValueError:
            value = {}
    return value if isinstance(value, dict) else {}


def stop_fields(totals: Totals) -> dict[str, Any]:
    stop_reason = STOP_REASONS.get(totals.ended_as, "end_turn")
    stop_sequence = totals.stop_reason if isinstance(totals.stop_reason, str) else None
    if stop_sequence is not None and stop_reason == "end_turn":
        stop_reason = "stop_sequence"
    return {"stop_reason": stop_reason, "stop_sequence": stop_sequence}


def usage(num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` are the prompt tokens computed for this request,
    `cache_read_input_tokens` those served from the prefix cache, and `cache_creation_input_tokens`
    is 0: the prefix cache fills by itself, with no cache_control breakpoint and no write charge,
    so nothing is "created" in Anthropic's sense. The prompt is the sum of the three (clients such
    as Claude Code add them up for their context meter)."""
    cached = min(num_cached_tokens, num_prompt_tokens)
    return {
        "input_tokens": num_prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": num_output_tokens,
    }


class MessagesEncoder:
    """One message's events and body (an api/pipeline.py Encoder)."""

    def __init__(self, started: Started) -> None:
        self.head = {
            "id": "msg_" + secrets.token_hex(12),
            "type": "message",
            "role": "assistant",
            "model": started.header.model,
        }
        self.num_prompt_tokens = len(started.prompts[0])
        first = started.stream.first_output
        self.num_cached_tokens = 0 if first is None else first.num_cached_tokens
        self.blocks = ContentBlocks()
        self.totals = Totals()

    def start(self) -> list[bytes]:
        start = {
            **self.head,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(self.num_prompt_tokens, self.num_cached_tokens, 0),
        }
        return [
            _encode("message_start", {"type": "message_start", "message": start}),
            _encode("ping", {"type": "ping"}),
        ]

    def add(self, delta: ChoiceDelta) -> list[bytes]:
        self.totals.add(delta)
        if not delta.parsed.is_empty:
            self.blocks.add(delta.parsed)
        return self._drain()

    def end(self) -> list[bytes]:
        self.blocks.close()
        return [
            *self._drain(),
            _encode(
                "message_delta", {"type": "message_delta", "delta": stop_fields(self.totals), "usage": self._usage()}
            ),
            _encode("message_stop", {"type": "message_stop"}),
        ]

    def error(self, error: APIError) -> list[bytes]:
        return [_encode("error", anthropic_error_body(error.status, error.message))]

    def done(self) -> list[bytes]:
        return []

    def body(self) -> dict[str, Any]:
        self.blocks.close()
        return {**self.head, "content": self.blocks.blocks, **stop_fields(self.totals), "usage": self._usage()}

    def _usage(self) -> dict[str, Any]:
        t = self.totals
        return usage(
            t.prompt_tokens or self.num_prompt_tokens, max(t.cached_tokens, self.num_cached_tokens), t.output_tokens
        )

    def _drain(self) -> list[bytes]:
        events = [_encode(kind, data) for kind, data in self.blocks.events]
        self.blocks.events.clear()
        return events


def _encode(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


async def create_message(request: Request) -> Response:
    state = server_state(request)
    m = validate(MessagesRequestModel, await read_json(request), state.config.limits)
    if m.max_tokens is None:
        raise bad_request("max_tokens: Field required", "max_tokens")
    started = await start_chat(request, m.to_chat_request(), "msg", MESSAGES)
    return await respond(request, started, MessagesEncoder(started))


async def count_tokens(request: Request) -> Response:
    """The prompt's token count: the same template render /v1/messages bills as input_tokens."""
    state = server_state(request)
    engine = state.ready_engine()
    chat = validate(MessagesRequestModel, await read_json(request), state.config.limits).to_chat_request()
    check_model(chat.model, engine)
    with refusals(MESSAGES):  # a prompt that cannot fit is refused from its length, as /v1/messages does
        return json_response({"input_tokens": len(await render_chat(state, engine, chat))})


MESSAGES_PREFIX = "/v1/messages"
MESSAGES_ROUTES = [
    Route(MESSAGES_PREFIX, create_message, methods=["POST"]),
    Route(f"{MESSAGES_PREFIX}/count_tokens", count_tokens, methods=["POST"]),
]
# Every error on these paths takes Anthropic's shape (its SDK reads no other), those refused before
# a route is matched too: the body's framing, the key, an unknown path below them, a wrong method.
MESSAGES_ERROR_SHAPE = ShapedPath(MESSAGES_PREFIX, to_anthropic)
