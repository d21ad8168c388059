"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the Responses API as a mapping onto the
chat pipeline (api/pipeline.py), with its own shapes (api/responses/output.py) and the bounded
store (api/responses/store.py)."""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api.access.keys import token_from_headers
from api.context_errors import RESPONSES
from api.errors import APIError, bad_request
from api.http import json_response, read_json, server_state
from api.pipeline import respond, start_chat
from api.request.validation import validate
from api.responses.output import ResponsesEncoder
from api.responses.request import ResponsesRequestModel
from api.responses.store import DEFAULT_RESPONSES_STORE_SIZE, ResponseStore, owner_of

logger = logging.getLogger("fp4serve.api")


def response_store(request: Request) -> ResponseStore:
    """One store per app, sized by --responses-store-size (made on first use)."""
    store = getattr(request.app.state, "responses_store", None)
    if store is None:
        size = getattr(server_state(request).config, "responses_store_size", DEFAULT_RESPONSES_STORE_SIZE)
        store = request.app.state.responses_store = ResponseStore(size)
    return store


def request_key(request: Request) -> bytes | None:
    """The API key the client sent, read by the same rule as authentication (api/access/keys.py)."""
    return token_from_headers(request.scope["headers"])[0]


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"no response with id {response_id!r} is stored", "response_id", "not_found")


async def create_response(request: Request) -> Response:
    state = server_state(request)
    m = validate(ResponsesRequestModel, await read_json(request), state.config.limits)
    store, owner = response_store(request), owner_of(request_key(request))
    history: list[dict[str, Any]] = []
    if m.previous_response_id is not None:
        previous = store.get(m.previous_response_id, owner)
        if previous is None:
            raise _not_found(m.previous_response_id)
        history = previous.messages
    tools = m.parsed_tools()
    if tools.tools is not None and len(tools.tools) > state.config.limits.max_tools:
        raise bad_request(
            f"tools has {len(tools.tools)} functions, namespaces included; this server allows at most "
            f"{state.config.limits.max_tools} (--max-tools)",
            "tools",
        )
    if tools.dropped:
        logger.warning(
            "POST /v1/responses: tools of type %s are not run by this server and the model does not see them",
            ", ".join(tools.dropped),
        )
    chat = m.to_chat_request(history, tools)
    started = await start_chat(request, chat, "resp", RESPONSES)
    return await respond(request, started, ResponsesEncoder(started, m, chat, tools, store, owner))


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


RESPONSES_ROUTES = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
]
