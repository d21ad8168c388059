"""Every error /v1/messages and /v1/messages/count_tokens answer is in Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`, with Anthropic's type names, and the
`anthropic` SDK raises its own exception class for each: a real server (hypercorn on 127.0.0.1,
in this process, the demo model) for the key's rate limit (429), a body over the limit (413),
validation (400), an unknown model (404), a wrong method (405); the app's handlers directly for
what a healthy test server cannot be made to do (a full queue, a dead engine, a crash)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import anthropic
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.testclient import TestClient
from starlette.types import Message, Receive, Scope, Send

from api.anthropic.routes import MESSAGES_ERROR_SHAPE
from api.app import ServerConfig, build_app
from api.error_shape import ErrorShapeMiddleware
from api.errors import (
    APIError,
    handle_api_error,
    handle_engine_dead,
    handle_engine_overloaded,
    handle_param_error,
    handle_unexpected,
)
from engine.config import EngineConfig
from engine.front import AsyncEngine
from engine.front.admission import EngineOverloadedError
from engine.front.async_engine import EngineDeadError
from engine.weights.demo_model import DEMO_MODEL_NAME
from scheduler.request import ParamError
from tests.api.test_tools_e2e import ENGINE
from tests.server_utils import HTTP, InProcessServer, in_process_server

KEY, LIMITED = "sk-errors-full", "sk-errors-limited"
MESSAGES = [{"role": "user", "content": "Hello"}]
MAX_REQUEST_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    keys = Path(tmp_path_factory.mktemp("keys")) / "keys.toml"
    keys.write_text(
        f'[[keys]]\nname = "full"\nkey = "{KEY}"\n\n[[keys]]\nname = "limited"\nkey = "{LIMITED}"\nrpm = 1\n'
    )
    config = ServerConfig(engine=ENGINE, api_keys_file=str(keys), max_request_bytes=MAX_REQUEST_BYTES)
    with in_process_server(config) as running:
        yield running


def sdk(server: InProcessServer, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url(""), api_key=key, max_retries=0, timeout=60)


def anthropic_type(error: anthropic.APIStatusError) -> str:
    body = error.body
    assert isinstance(body, dict) and body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["message"]
    return body["error"]["type"]


@pytest.mark.slow
def test_rate_limit_is_a_rate_limit_error_with_retry_after(server: InProcessServer) -> None:
    client = sdk(server, LIMITED)
    assert client.messages.count_tokens(model=DEMO_MODEL_NAME, messages=MESSAGES).input_tokens > 0  # the one a minute
    with pytest.raises(anthropic.RateLimitError) as refused:
        client.messages.create(model=DEMO_MODEL_NAME, max_tokens=1, messages=MESSAGES)
    assert anthropic_type(refused.value) == "rate_limit_error"
    assert "requests per minute" in refused.value.message
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert refused.value.response.headers["x-ratelimit-limit-requests"] == "1"
    with pytest.raises(anthropic.RateLimitError) as again:
        client.messages.count_tokens(model=DEMO_MODEL_NAME, messages=MESSAGES)
    assert anthropic_type(again.value) == "rate_limit_error"
    # The OpenAI routes keep OpenAI's shape for the same refusal.
    openai_shape = HTTP.post(
        server.url("/v1/completions"),
        headers={"Authorization": f"Bearer {LIMITED}"},
        json={"model": DEMO_MODEL_NAME, "prompt": "a", "max_tokens": 1},
        timeout=30,
    )
    assert openai_shape.status_code == 429 and openai_shape.json()["error"]["code"] == "rate_limit_exceeded"


@pytest.mark.slow
def test_validation_model_size_and_method_errors(server: InProcessServer) -> None:
    client = sdk(server)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=DEMO_MODEL_NAME, max_tokens=5, messages=[{"role": "robot", "content": "hi"}])
    assert anthropic_type(bad.value) == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as bad_count:
        client.messages.count_tokens(model=DEMO_MODEL_NAME, messages=[])
    assert anthropic_type(bad_count.value) == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.count_tokens(model="claude-not-served", messages=MESSAGES)
    assert anthropic_type(missing.value) == "not_found_error"
    with pytest.raises(anthropic.ContentTooLargeError) as large:
        client.messages.create(
            model=DEMO_MODEL_NAME, max_tokens=5, messages=[{"role": "user", "content": "word " * MAX_REQUEST_BYTES}]
        )
    assert anthropic_type(large.value) == "request_too_large"
    headers = {"x-api-key": KEY}
    wrong_method = HTTP.get(server.url("/v1/messages"), headers=headers, timeout=30)
    assert wrong_method.status_code == 405 and wrong_method.json()["type"] == "error"
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    no_route = HTTP.post(server.url("/v1/messages/batches"), headers=headers, json={}, timeout=30)
    assert no_route.status_code == 404 and no_route.json()["error"]["type"] == "not_found_error"
    # A streamed request refused before it starts gets a JSON error too, which the SDK raises.
    with pytest.raises(anthropic.NotFoundError):
        with client.messages.stream(model="claude-not-served", max_tokens=5, messages=MESSAGES) as stream:
            list(stream)


def _request(path: str) -> Request:
    """A request as the handlers get it: its scope through the middleware that puts the error shape
    the routes declared on it."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [],
        "app": Starlette(),
        "query_string": b"",
        "server": ("127.0.0.1", 80),
        "scheme": "http",
    }

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        pass

    asyncio.run(ErrorShapeMiddleware(route, [MESSAGES_ERROR_SHAPE])(scope, _no_receive, _no_send))
    return Request(scope)


async def _no_receive() -> Message:
    raise AssertionError("the shape is chosen from the path alone")


async def _no_send(message: Message) -> None:
    raise AssertionError("the shape is chosen from the path alone")


@pytest.mark.parametrize(
    ("handler", "exc", "status", "kind"),
    [
        (handle_engine_overloaded, EngineOverloadedError("the waiting queue is full"), 503, "overloaded_error"),
        (handle_engine_dead, EngineDeadError("the engine died"), 503, "overloaded_error"),
        (handle_param_error, ParamError("top_k must be -1 or positive", "top_k"), 400, "invalid_request_error"),
        (handle_api_error, APIError(500, "generation failed: boom", code="engine_error"), 500, "api_error"),
        (
            handle_api_error,
            APIError(504, "the request took longer than 5 s", code="request_timeout"),
            504,
            "timeout_error",
        ),
        (handle_unexpected, RuntimeError("secret internals"), 500, "api_error"),
    ],
)
def test_the_apps_handlers_answer_messages_paths_in_anthropics_shape(handler, exc, status, kind) -> None:  # noqa: ANN001
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        response = asyncio.run(handler(_request(path), exc))
        body = orjson.loads(bytes(response.body))
        assert response.status_code == status and body["type"] == "error" and body["error"]["type"] == kind
        assert "secret" not in body["error"]["message"]
        if status == 503:
            assert int(response.headers["retry-after"]) >= 1
    openai = orjson.loads(bytes(asyncio.run(handler(_request("/v1/chat/completions"), exc)).body))
    assert set(openai) == {"error"} and openai["error"]["message"] == body["error"]["message"]


def _never_loads(config: EngineConfig) -> AsyncEngine:
    raise AssertionError("no engine: the lifespan does not run")


def test_refusals_before_any_route_take_the_shape_the_messages_routes_declare() -> None:
    # The key middleware's 401 and routing's 404 and 405 come before a route runs; the app's own
    # middleware (no lifespan, so no engine) must still answer /v1/messages/... in Anthropic's shape.
    app = build_app(ServerConfig(engine=ENGINE, api_key=KEY), loader=_never_loads)
    client = TestClient(app)
    headers = {"x-api-key": KEY}
    for response, status, kind in (
        (client.post("/v1/messages", json={}), 401, "authentication_error"),
        (
            client.post("/v1/messages/count_tokens", headers={"x-api-key": "sk-wrong"}, json={}),
            401,
            "authentication_error",
        ),
        (client.post("/v1/messages/batches", headers=headers, json={}), 404, "not_found_error"),
        (client.get("/v1/messages", headers=headers), 405, "invalid_request_error"),
    ):
        assert response.status_code == status and response.json() == {
            "type": "error",
            "error": {"type": kind, "message": response.json()["error"]["message"]},
        }
    assert client.post("/v1/messages", json={}).headers["www-authenticate"] == "Bearer"
    # Every other path keeps OpenAI's shape, one that only starts like the Messages path too.
    for path in ("/v1/chat/completions", "/v1/messagesx"):
        openai = client.post(path, json={})
        assert openai.status_code == 401 and set(openai.json()) == {"error"}
        assert openai.json()["error"]["code"] == "invalid_api_key"
