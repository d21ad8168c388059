"""Thin HTTP handlers: /v1/chat/completions and /v1/completions (read, validate, and through the
pipeline, api/pipeline.py, with their shapes from api/openai/chat.py and api/openai/completions.py); models,
usage, health, version, metrics and the OpenAPI document; and the one `ROUTES` list of these and
/tokenize, /detokenize (api/openai/tokenize.py). Lifecycle lives in api/app.py."""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import replace
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api.access.keys import KEY_STATE, OPEN, KeyRecord
from api.context_errors import CHAT
from api.http import json_response, read_json, server_state
from api.openai.chat import ChatEncoder
from api.openai.completions import CompletionEncoder, echoed_prompt
from api.openai.tokenize import TOKENIZE_ROUTES
from api.ops.openapi import openapi_schema
from api.pipeline import respond, start_chat, start_completion
from api.request.models import ChatCompletionRequest, CompletionRequestModel
from api.request.validation import validate

logger = logging.getLogger("fp4serve")


async def chat_completions(request: Request) -> Response:
    state = server_state(request)
    chat = validate(ChatCompletionRequest, await read_json(request), state.config.limits)
    dialect = replace(CHAT, max_tokens_param="max_completion_tokens") if chat.max_completion_tokens else CHAT
    started = await start_chat(request, chat, "chatcmpl", dialect)
    return await respond(request, started, ChatEncoder(started, chat))


async def completions(request: Request) -> Response:
    state = server_state(request)
    state.ready_engine()
    req = validate(CompletionRequestModel, await read_json(request), state.config.limits)
    started = await start_completion(request, req)
    echoed = None
    if req.echo:
        inputs = state.ready_engine().input_processor
        echoed = [
            await state.run_blocking(echoed_prompt, inputs, sent, ids) for sent, ids in zip(req.prompt, started.prompts)
        ]
    return await respond(request, started, CompletionEncoder(started, req, echoed))


async def usage(request: Request) -> Response:
    """The caller's token and request totals since start; an admin key gets every key's."""
    state = server_state(request)
    record: KeyRecord = request.scope.get("state", {}).get(KEY_STATE, OPEN)
    totals = state.engine.metrics.usage if state.engine is not None else {}
    names = sorted(set(totals) | set(state.keys.names())) if record.admin else [record.name]
    from engine.front import KeyUsage

    return json_response(
        {
            "object": "usage",
            "key": record.name,
            "since": state.started_at,
            "data": [{"key": name, **totals.get(name, KeyUsage()).as_dict()} for name in names],
        }
    )


async def models(request: Request) -> Response:
    state = server_state(request)
    info = state.ready_engine().info
    card = {
        "id": info.model_name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "fp4serve",
        "root": public_root(state.config.engine.model, info.model_name),
        "max_model_len": info.max_model_len,
    }
    return json_response({"object": "list", "data": [card]})


def public_root(model: str | None, served_name: str) -> str:
    """The `root` /v1/models shows: the model as the operator named it (--model), a hub-style name
    as given, a folder by its last part only. NOTE: never a filesystem path: for a built-in model
    or a converted GGUF that is a cache path under the server user's home, and any key holder
    reads this."""
    if model is None:
        return served_name
    path = Path(model).expanduser()
    if model.startswith((".", "~", "/")) or path.exists():
        return path.resolve().name or served_name
    return model


async def health(request: Request) -> Response:
    status, body = server_state(request).health()
    return json_response(body, status=status)


async def version(request: Request) -> Response:
    try:
        value = importlib.metadata.version("fp4serve")
    except importlib.metadata.PackageNotFoundError:
        value = "unknown"
    return json_response({"version": value})


async def openapi(request: Request) -> Response:
    """The request models as an OpenAPI 3.1 document (api/ops/openapi.py)."""
    try:
        value = importlib.metadata.version("fp4serve")
    except importlib.metadata.PackageNotFoundError:
        value = "unknown"
    return json_response(openapi_schema(value))


async def metrics(request: Request) -> Response:
    state = server_state(request)
    # NOTE: served during a drain and after an engine failure too, when scrapes matter most; only
    # before the engine exists is it a 503 (ready_engine raises it).
    engine = state.engine or state.ready_engine()
    text = generate_latest(engine.metrics.registry) + generate_latest(state.metrics.registry)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/usage", usage, methods=["GET"]),
    *TOKENIZE_ROUTES,
    Route("/health", health, methods=["GET"]),
    Route("/version", version, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/openapi.json", openapi, methods=["GET"]),
]
