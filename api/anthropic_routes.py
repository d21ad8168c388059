"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API as a front-end of
the chat pipeline (api/routes.py `start_chat`, the same output parsers). Parsed deltas become
content blocks — `thinking`, `text`, `tool_use` — and, streaming, Anthropic's events:

    message_start, ping,
    per block: content_block_start, content_block_delta* (thinking_delta, text_delta,
               input_json_delta), content_block_stop,
    message_delta (stop_reason, usage), message_stop.

Errors keep Anthropic's shape: the app's exception handlers re-shape them by path
(api/errors.py `for_path`, api/anthropic_errors.py), and in a stream they are an `error` event."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from api.anthropic_errors import anthropic_error_body
from api.anthropic_request import chat_body, parse_messages_request
from api.errors import APIError
from api.parsed_stream import Totals, make_parser, parsed_deltas
from api.parsers.base import ParsedDelta
from api.protocol import parse_chat_request
from api.routes import check_model, json_response, read_json, server_state, start_chat, unless_disconnected
from api.sse import SSEResponse

logger = logging.getLogger("fp4serve.api")

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
                self._start({"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
                             "input": {}})
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
            try:
                block["input"] = json.loads("".join(self._arguments) or "{}")
            except ValueError:
                block["input"] = {}  # a stream cut inside the call: its deltas were sent as they were
            self._arguments.clear()
        self.events.append(("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1}))

    def _start(self, block: dict[str, Any]) -> None:
        self.close()
        self.blocks.append(block)
        self._open = block
        shown = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        self.events.append(("content_block_start",
                            {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": shown}))

    def _delta(self, delta: dict[str, Any]) -> None:
        self.events.append(("content_block_delta",
                            {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}))


def stop_fields(totals: Totals) -> dict[str, Any]:
    stop_reason = STOP_REASONS.get(totals.finish_reason or "abort", "end_turn")
    stop_sequence = totals.stop_reason if isinstance(totals.stop_reason, str) else None
    if stop_sequence is not None and stop_reason == "end_turn":
        stop_reason = "stop_sequence"
    return {"stop_reason": stop_reason, "stop_sequence": stop_sequence}


def usage(totals: Totals) -> dict[str, Any]:
    return {"input_tokens": totals.prompt_tokens, "output_tokens": totals.output_tokens,
            "cache_read_input_tokens": totals.cached_tokens, "cache_creation_input_tokens": 0}


async def create_message(request: Request) -> Response:
    state = server_state(request)
    body = await read_json(request, state.config.max_request_bytes)
    m = parse_messages_request(body, need_max_tokens=True)
    chat = parse_chat_request(chat_body(m), state.config.limits)
    started = await start_chat(request, chat, "msg")
    message_id = "msg_" + secrets.token_hex(12)
    model = started.header.model
    streaming = bool(m.stream)
    parser = make_parser(state.parsers, chat, started.opens_reasoning, streaming=streaming)
    totals = Totals()
    blocks = ContentBlocks()
    head = {"id": message_id, "type": "message", "role": "assistant", "model": model}

    if not streaming:
        async def complete() -> dict[str, Any]:
            async for delta in parsed_deltas(started.outputs, parser, totals):
                blocks.add(delta)
            blocks.close()
            return {**head, "content": blocks.blocks, **stop_fields(totals), "usage": usage(totals)}

        return json_response(await unless_disconnected(complete(), request.receive))

    def encode(kind: str, data: dict[str, Any]) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    async def events() -> AsyncIterator[bytes]:
        start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": len(started.prompt), "output_tokens": 0}}
        yield encode("message_start", {"type": "message_start", "message": start})
        yield encode("ping", {"type": "ping"})
        try:
            async for delta in parsed_deltas(started.outputs, parser, totals):
                blocks.add(delta)
                for kind, data in blocks.events:
                    yield encode(kind, data)
                blocks.events.clear()
            blocks.close()
            for kind, data in blocks.events:
                yield encode(kind, data)
            yield encode("message_delta", {"type": "message_delta", "delta": stop_fields(totals), "usage": usage(totals)})
            yield encode("message_stop", {"type": "message_stop"})
        except asyncio.CancelledError:
            raise
        except APIError as e:
            yield encode("error", anthropic_error_body(e.status, e.message))
        except Exception:
            logger.exception("messages stream %s failed", message_id)
            yield encode("error", anthropic_error_body(500, "generation failed; see the server log"))

    return SSEResponse(events())


async def count_tokens(request: Request) -> Response:
    """The prompt's token count: the same template render /v1/messages bills as input_tokens."""
    state = server_state(request)
    engine = state.ready_engine()
    body = await read_json(request, state.config.max_request_bytes)
    m = parse_messages_request(body, need_max_tokens=False)
    chat = parse_chat_request({**chat_body(m), "stream": False}, state.config.limits)
    check_model(chat.model, engine)
    prompt = await state.run_blocking(
        engine.input_processor.render_chat, chat.messages, chat.tools, chat.add_generation_prompt, chat.template_kwargs
    )
    return json_response({"input_tokens": len(prompt)})
