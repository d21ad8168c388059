"""Thin HTTP handlers: read and parse the body, admit the request (api/admission.py), hand the
prompt to the engine, stream or return the result before its deadline (api/deadline.py); and
/tokenize, /detokenize with the server's own tokenizer. Lifecycle lives in api/app.py, shapes
in api/chat.py and api/completions.py."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from dataclasses import dataclass, replace
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from api.keys import KEY_STATE, OPEN, KeyRecord, bind_request_priority, token_from_headers, unauthorized_message
from api.chat import ChatResponder, prompt_closes_reasoning, prompt_opens_reasoning
from api.completions import CompletionResponder, echoed_prompt
from api.errors import APIError, bad_request
from api.generation import ClientDisconnected, Outputs, start_outputs, unless_disconnected
from api.inflight import request_deadline
from api.protocol import (
    ChatRequest,
    TokenizeRequest,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
    resolve_max_tokens,
)
from api.response_format import response_format_grammar
from api.responses import ResponseHeader
from api.sse import SSEResponse
from api.tool_grammar import tool_call_grammar

if TYPE_CHECKING:
    from api.state import ServerState
    from engine.async_engine import AsyncEngine

logger = logging.getLogger("fp4serve")

# NOTE: an oversized body is still read (and dropped) up to this much more: answering while the
# client is still sending makes the close reset the connection, and the client never sees the 413.
DRAIN_BYTES = 64 << 20


def json_response(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status_code=status, media_type="application/json")


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, read with a cap (Content-Length may be absent or wrong) and
    within --body-timeout: a slow upload gets a 408; a client that leaves mid-upload one INFO line."""
    timeout_s = server_state(request).config.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            body = await _read_body(request, limit)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s (--body-timeout)",
                       code="request_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:
        logger.info("client left while sending the body of %s %s", request.method, request.url.path)
        raise ClientDisconnected() from None
    if not body:
        raise bad_request("request body is empty; send a JSON object")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(payload, dict):
        raise bad_request("request body must be a JSON object")
    return payload


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    too_big = declared is not None and declared.isdigit() and int(declared) > limit
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        too_big = too_big or size > limit
        if not too_big:
            chunks.append(chunk)
        elif size > limit + DRAIN_BYTES:
            break
    if too_big:
        raise APIError(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large")
    return b"".join(chunks)


def check_model(requested: str | None, engine: AsyncEngine) -> None:
    if requested is not None and requested != engine.info.model_name:
        raise APIError(
            404, f"model {requested!r} does not exist; this server serves {engine.info.model_name!r}", "model", "model_not_found"
        )


async def chat_completions(request: Request) -> Response:
    state = server_state(request)
    body = await read_json(request, state.config.max_request_bytes)
    chat = parse_chat_request(body, state.config.limits)
    bind_request_priority(body.get("priority"))
    started = await start_chat(request, chat, "chatcmpl")
    responder = ChatResponder(started.header, chat, started.prompt, state.parsers, started.opens_reasoning)
    if chat.stream.stream:
        return SSEResponse(responder.stream(started.outputs))
    return await _complete(request, responder.complete(started.outputs))


@dataclass(frozen=True)
class StartedChat:
    header: ResponseHeader
    prompt: list[int]
    opens_reasoning: bool  # the template left a <think> block open: the output starts as reasoning
    outputs: Outputs


async def start_chat(request: Request, chat: ChatRequest, id_prefix: str) -> StartedChat:
    """A parsed chat request through the chat template into the engine, with its grammar
    (response_format, or a forced tool call): what /v1/chat/completions, /v1/responses and
    /v1/messages share; only the response shapes differ."""
    state = server_state(request)
    engine = state.ready_engine()
    check_model(chat.model, engine)
    inputs = engine.input_processor
    with state.admission.preparing(engine):
        prompt = await state.run_blocking(
            inputs.render_chat, chat.messages, chat.tools, chat.add_generation_prompt, chat.template_kwargs
        )
    limits = state.config.limits
    params = resolve_max_tokens(
        chat.params, chat.max_tokens, len(prompt), engine.info.max_model_len, "messages", limits.max_output_tokens
    )
    tail = inputs.prompt_tail(prompt) if state.parsers.reasoning_parser is not None else ""
    opens_reasoning = prompt_opens_reasoning(tail)
    params = replace(params, grammar=_grammar(chat, state, tail, opens_reasoning))
    header = ResponseHeader.new(id_prefix, engine.info.model_name)
    outputs = await start_outputs(engine, [prompt], [params], header.id, request.receive, request_deadline(request.scope))
    return StartedChat(header, prompt, opens_reasoning, outputs)


def _grammar(chat: ChatRequest, state: ServerState, prompt_tail: str, opens_reasoning: bool) -> str | None:
    """The grammar that enforces response_format, or tool_choice "required" or a named function
    (api/protocol.py refuses both at once); None when the output is free."""
    forces_call = bool(chat.tools) and chat.tool_choice not in (None, "auto", "none")
    if chat.response_format is None and not forces_call:
        return None
    # A think block may come first unless the prompt closed it (enable_thinking=false).
    reasoning = state.parsers.reasoning_parser is not None and not prompt_closes_reasoning(prompt_tail)
    if chat.response_format is not None:
        return response_format_grammar(chat.response_format, reasoning, starts_in_reasoning=opens_reasoning)
    if state.parsers.tool_parser is None:
        raise bad_request(
            "tool_choice 'required' or a named function needs the server to run with --tool-parser", "tool_choice"
        )
    return tool_call_grammar(
        chat.tools,
        chat.tool_choice,
        state.parsers.tool_parser,
        reasoning=reasoning,
        starts_in_reasoning=opens_reasoning,
        parallel_tool_calls=chat.parallel_tool_calls,
    )


async def completions(request: Request) -> Response:
    state = server_state(request)
    engine = state.ready_engine()
    body = await read_json(request, state.config.max_request_bytes)
    limits = state.config.limits
    req = parse_completion_request(body, limits)
    bind_request_priority(body.get("priority"))
    if len(req.prompts) > state.config.max_prompts:
        raise bad_request(f"{len(req.prompts)} prompts in one request; the limit is {state.config.max_prompts} "
                          "(--max-prompts)", "prompt")
    check_model(req.model, engine)
    with state.admission.preparing(engine):
        prompts = [p if isinstance(p, list) else await state.run_blocking(engine.input_processor.encode, p)
                   for p in req.prompts]
    if any(not p for p in prompts):
        raise bad_request("a prompt encodes to no tokens", "prompt")
    max_len, cap = engine.info.max_model_len, limits.max_output_tokens
    grammar = None if req.response_format is None else response_format_grammar(req.response_format, reasoning=False)
    params = [
        replace(resolve_max_tokens(req.params, req.max_tokens, len(p), max_len, "prompt", cap), grammar=grammar)
        for p in prompts
    ]
    header = ResponseHeader.new("cmpl", engine.info.model_name)
    echoed = None
    if req.echo:
        echoed = [await state.run_blocking(echoed_prompt, engine.input_processor, sent, ids)
                  for sent, ids in zip(req.prompts, prompts)]
    responder = CompletionResponder(header, req, prompts, echoed)
    outputs = await start_outputs(engine, prompts, params, header.id, request.receive, request_deadline(request.scope))
    if req.stream.stream:
        return SSEResponse(responder.stream(outputs))
    return await _complete(request, responder.complete(outputs))


async def _complete(request: Request, body: Awaitable[dict[str, Any]]) -> Response:
    """A non-streaming response; a client that leaves meanwhile aborts its request."""
    return json_response(await unless_disconnected(body, request.receive))


async def tokenize(request: Request) -> Response:
    """vLLM's POST /tokenize: `tokens`, `count` and `max_model_len` (and `token_strs` on request)."""
    state = server_state(request)
    _check_api_key(request, state)
    engine = state.ready_engine()
    req = parse_tokenize_request(await read_json(request, state.config.max_request_bytes), state.config.limits)
    check_model(req.model, engine)
    token_ids = await state.run_blocking(_tokenize, engine.tokenizer, req)
    body: dict[str, Any] = {"tokens": token_ids, "count": len(token_ids), "max_model_len": engine.info.max_model_len}
    if req.return_token_strs:
        body["token_strs"] = [engine.tokenizer.backend.id_to_token(t) for t in token_ids]
    return json_response(body)


def _tokenize(tokenizer: Any, req: TokenizeRequest) -> list[int]:
    """Blocking (run it off the loop). NOTE: messages go through the same calls as
    InputProcessor.render_chat, so the count equals a chat request's usage.prompt_tokens."""
    if req.messages is None:
        assert req.prompt is not None, "TokenizeRequest holds a prompt or messages"
        return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    text = tokenizer.render_chat(req.messages, req.tools, req.add_generation_prompt, **req.template_kwargs)
    return tokenizer.encode(text, add_special_tokens=req.add_special_tokens)


async def detokenize(request: Request) -> Response:
    """vLLM's POST /detokenize: token ids back to text, special tokens included."""
    state = server_state(request)
    _check_api_key(request, state)
    engine = state.ready_engine()
    body = await read_json(request, state.config.max_request_bytes)
    req = parse_detokenize_request(body, engine.tokenizer.vocab_size)
    check_model(req.model, engine)
    text = await state.run_blocking(engine.tokenizer.decode, req.token_ids, False)
    return json_response({"prompt": text})


def _check_api_key(request: Request, state: ServerState) -> None:
    """NOTE: api/keys.py's middleware guards /v1/* only, and these routes live at the root as in
    vLLM: they check the same keys, the same way, themselves."""
    token, sent = token_from_headers(request.scope["headers"])
    if state.keys.lookup(token) is None:
        raise APIError(401, unauthorized_message(sent), code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def usage(request: Request) -> Response:
    """The caller's token and request totals since start; an admin key gets every key's."""
    state = server_state(request)
    record: KeyRecord = request.scope.get("state", {}).get(KEY_STATE, OPEN)
    totals = state.engine.metrics.usage if state.engine is not None else {}
    names = sorted(set(totals) | set(state.keys.names())) if record.admin else [record.name]
    from engine.metrics import KeyUsage

    return json_response({
        "object": "usage",
        "key": record.name,
        "since": state.started_at,
        "data": [{"key": name, **totals.get(name, KeyUsage()).as_dict()} for name in names],
    })


async def models(request: Request) -> Response:
    state = server_state(request)
    info = state.ready_engine().info
    card = {
        "id": info.model_name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "fp4serve",
        "root": info.model_path,
        "max_model_len": info.max_model_len,
    }
    return json_response({"object": "list", "data": [card]})


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
    """The request models (api/models.py) as an OpenAPI 3.1 document."""
    from api.models import openapi_schema

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
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/health", health, methods=["GET"]),
    Route("/version", version, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
    Route("/openapi.json", openapi, methods=["GET"]),
]
