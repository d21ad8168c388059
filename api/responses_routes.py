"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the Responses API as a front-end of
the chat pipeline (api/routes.py `start_chat`, the same output parsers), with its own shapes
(api/responses_output.py) and the bounded store (api/responses_store.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from api.auth import bearer_token
from api.errors import APIError
from api.parsed_stream import Totals, make_parser, parsed_deltas
from api.protocol import parse_chat_request
from api.responses_output import OutputItems, assistant_messages, new_id, now, response_body
from api.responses_request import chat_body, parse_responses_request
from api.responses_store import DEFAULT_RESPONSES_STORE_SIZE, ResponseStore, StoredResponse, owner_of
from api.routes import json_response, read_json, server_state, start_chat, unless_disconnected
from api.sse import SSEResponse

logger = logging.getLogger("fp4serve.api")


def response_store(request: Request) -> ResponseStore:
    """One store per app, sized by --responses-store-size (made on first use)."""
    store = getattr(request.app.state, "responses_store", None)
    if store is None:
        size = getattr(server_state(request).config, "responses_store_size", DEFAULT_RESPONSES_STORE_SIZE)
        store = request.app.state.responses_store = ResponseStore(size)
    return store


def request_key(request: Request) -> bytes | None:
    """The API key the client sent: `Authorization: Bearer` or Anthropic's `x-api-key`."""
    headers = dict(request.scope["headers"])
    return bearer_token(headers.get(b"authorization")) or headers.get(b"x-api-key") or None


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no response with id {response_id!r} is stored", "response_id", "not_found")


async def create_response(request: Request) -> Response:
    state = server_state(request)
    body = await read_json(request, state.config.max_request_bytes)
    m = parse_responses_request(body)
    store, owner = response_store(request), owner_of(request_key(request))
    history: list[dict[str, Any]] = []
    if m.previous_response_id is not None:
        previous = store.get(m.previous_response_id, owner)
        if previous is None:
            raise _not_found(m.previous_response_id)
        history = previous.messages
    chat = parse_chat_request(chat_body(m, history), state.config.limits)
    started = await start_chat(request, chat, "resp")
    response_id = new_id("resp")
    created_at = now()
    model = started.header.model
    streaming = bool(m.stream)
    parser = make_parser(state.parsers, chat, started.opens_reasoning, streaming=streaming)
    totals = Totals()
    items = OutputItems()
    should_store = m.store is not False

    def finished_body() -> dict[str, Any]:
        items.close(incomplete=totals.finish_reason == "length")
        final = response_body(response_id, model, created_at, m, items.items, totals, m.previous_response_id, should_store)
        if should_store:
            own_messages = [msg for msg in chat.messages if not (m.instructions and msg is chat.messages[0])]
            conversation = own_messages + assistant_messages(items.items)
            store.put(response_id, StoredResponse(owner, final, conversation))
        return final

    if not streaming:
        async def complete() -> dict[str, Any]:
            async for delta in parsed_deltas(started.outputs, parser, totals):
                items.add(delta)
            return finished_body()

        return json_response(await unless_disconnected(complete(), request.receive))

    async def events() -> AsyncIterator[bytes]:
        sequence = 0

        def encode(event: dict[str, Any]) -> bytes:
            nonlocal sequence
            event = {**event, "sequence_number": sequence}
            sequence += 1
            return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"

        pending = response_body(response_id, model, created_at, m, [], None, m.previous_response_id, should_store)
        yield encode({"type": "response.created", "response": pending})
        yield encode({"type": "response.in_progress", "response": pending})
        try:
            async for delta in parsed_deltas(started.outputs, parser, totals):
                if parser is not None:
                    items.mark_broken(parser.broken_calls)
                items.add(delta)
                for event in items.events:
                    yield encode(event)
                items.events.clear()
            if parser is not None:
                items.mark_broken(parser.broken_calls)
            final = finished_body()
            for event in items.events:
                yield encode(event)
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            yield encode({"type": kind, "response": final})
        except asyncio.CancelledError:
            raise
        except APIError as e:
            yield encode({"type": "error", "code": e.code, "message": e.message, "param": None})
        except Exception:
            logger.exception("responses stream %s failed", response_id)
            yield encode({"type": "error", "code": "server_error", "message": "generation failed; see the server log",
                          "param": None})

    return SSEResponse(events())


async def get_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    entry = response_store(request).get(response_id, owner_of(request_key(request)))
    if entry is None:
        raise _not_found(response_id)
    return json_response(entry.body)


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not response_store(request).delete(response_id, owner_of(request_key(request))):
        raise _not_found(response_id)
    return json_response({"id": response_id, "object": "response.deleted", "deleted": True})

