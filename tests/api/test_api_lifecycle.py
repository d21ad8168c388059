"""The HTTP layer without a model: /health and /v1/* while the engine loads or after it
failed, API-key and CORS middleware, SSE framing, and closing engine streams on disconnect."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import orjson
import pytest
from starlette.testclient import TestClient

from api.access.auth import bearer_token
from api.app import ServerConfig, build_app
from api.engine_stream import EngineStream
from api.http import ClientDisconnected, unless_disconnected
from api.pipeline import start_stream
from api.transport.sse import DONE, SSEResponse, encode_error_event, encode_event
from engine.config import EngineConfig
from engine.core_types import Owner
from engine.errors import ConfigError
from engine.front.outputs import RequestOutput
from scheduler.request import SamplingParams

KEY = "sk-lifecycle"


class LoaderGate:
    """A loader that holds start-up until released, then fails the way a bad checkpoint does."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.fatal_calls = 0

    def load(self, config: EngineConfig) -> Any:
        assert self.release.wait(30), "test never released the loader"
        raise ConfigError("/models/x/config.json: missing field 'hidden_size'")

    def on_fatal(self) -> None:
        self.fatal_calls += 1


@pytest.fixture
def gate() -> Iterator[LoaderGate]:
    gate = LoaderGate()
    yield gate
    gate.release.set()


@contextmanager
def make_client(gate: LoaderGate, **config: Any) -> Iterator[TestClient]:
    app = build_app(ServerConfig(engine=EngineConfig(), **config), loader=gate.load, on_fatal=gate.on_fatal)
    with TestClient(app, raise_server_exceptions=False) as client:
        try:
            yield client
        finally:
            gate.release.set()  # shutdown joins the loader thread; let it finish now


def test_health_and_api_answer_503_while_loading_then_after_a_failed_load(gate: LoaderGate) -> None:
    with make_client(gate) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        busy = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "2"
        assert busy.json() == {
            "error": {
                "message": "the model is still loading",
                "type": "unavailable_error",
                "param": None,
                "code": "server_loading",
            }
        }
        assert client.get("/metrics").status_code == 503
        assert client.get("/version").status_code == 200
        gate.release.set()
        deadline = time.monotonic() + 10
        while client.get("/health").json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        failed = client.get("/health")
        assert failed.status_code == 503 and failed.json()["status"] == "failed"
        assert "missing field 'hidden_size'" in failed.json()["error"]["message"]
        assert gate.fatal_calls == 1


def test_health_turns_503_once_shutdown_begins(gate: LoaderGate) -> None:
    with make_client(gate) as client:
        client.app.state.server.begin_shutdown()
        response = client.get("/health")
        assert response.status_code == 503 and response.json()["status"] == "stopping"
        assert client.get("/v1/models").json()["error"]["code"] == "server_stopping"


@pytest.mark.parametrize(
    ("authorization", "status"),
    [(None, 401), ("Bearer nope", 401), (f"Basic {KEY}", 401), (f"Bearer {KEY}", 503), (f"bearer  {KEY} ", 503)],
)
def test_api_key_guards_v1_only(gate: LoaderGate, authorization: str | None, status: int) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    with make_client(gate, api_key=KEY) as client:
        response = client.get("/v1/models", headers=headers)
        assert response.status_code == status  # 503: past the key check, the model is loading
        if status == 401:
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/health", headers=headers).status_code == 503


def test_bearer_token_parsing() -> None:
    assert bearer_token(b"Bearer abc") == b"abc"
    assert bearer_token(b"BEARER abc ") == b"abc"
    assert bearer_token(b"Bearer ") is None
    assert bearer_token(b"Token abc") is None
    assert bearer_token(None) is None


def test_cors_headers_only_when_origins_are_configured(gate: LoaderGate) -> None:
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    with make_client(gate, cors_origins=("https://app.example",), api_key=KEY) as client:
        response = client.options("/v1/chat/completions", headers=preflight)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "https://app.example"
        denied = client.get("/v1/models", headers={"Origin": "https://app.example"})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "https://app.example"
    with make_client(gate) as client:
        assert "access-control-allow-origin" not in client.get("/health", headers={"Origin": "https://a.b"}).headers


def test_sse_events_are_single_data_lines() -> None:
    event = encode_event({"text": "a\nb", "n": 1})
    assert event == b'data: {"text":"a\\nb","n":1}\n\n'
    assert orjson.loads(encode_error_event("boom")[len(b"data: ") :]) == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": None}
    }
    assert DONE == b"data: [DONE]\n\n"


def test_sse_response_closes_its_generator_when_the_client_leaves_during_a_send() -> None:
    async def run() -> bool:
        closed, stalled = asyncio.Event(), asyncio.Event()

        async def events() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b"data: {}\n\n"
            finally:
                closed.set()

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                stalled.set()
                await asyncio.Event().wait()  # a stalled socket: the generator stays parked at `yield`

        async def receive() -> dict[str, Any]:
            await stalled.wait()  # the client leaves while the body is being sent
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"spec_version": "2.1"}, "method": "GET", "headers": []}
        await asyncio.wait_for(SSEResponse(events())(scope, receive, send), 30)
        return closed.is_set()

    assert asyncio.run(run()), "the generator's finally must run when the response ends"


class ScriptedEngine:
    """Plays fixed outputs per prompt with a delay between them; records closed generators."""

    def __init__(self, num_outputs: int, delay: float = 0.001) -> None:
        self.num_outputs = num_outputs
        self.delay = delay
        self.closed: list[str] = []

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, owner: Owner = Owner()
    ) -> AsyncIterator[RequestOutput]:
        return self._stream(prompt_token_ids, request_id)

    async def _stream(self, prompt: list[int], request_id: str) -> AsyncIterator[RequestOutput]:
        try:
            for i in range(self.num_outputs):
                await asyncio.sleep(self.delay)
                last = i == self.num_outputs - 1
                yield RequestOutput(
                    request_id, 0, (i,), f"{prompt[0]}:{i} ", "length" if last else None, len(prompt), i + 1
                )
        finally:
            self.closed.append(request_id)


async def never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


async def start(engine: ScriptedEngine, num_prompts: int, receive: Any = never_disconnects) -> EngineStream:
    return await start_stream(
        engine,
        [[p] for p in range(num_prompts)],
        SamplingParams(),
        "r",  # type: ignore[arg-type]
        Owner(),
        receive,
        None,
    )


@pytest.mark.parametrize("num_prompts", [1, 3])
def test_outputs_of_every_prompt_arrive_tagged_with_their_prompt(num_prompts: int) -> None:
    engine = ScriptedEngine(num_outputs=4)

    async def run() -> list[tuple[int, str]]:
        stream = await start(engine, num_prompts)
        got = []
        while (item := await stream.next()) is not None:
            got.append((item[0], item[1].text_delta))
        return got

    got = asyncio.run(run())
    for p in range(num_prompts):
        assert [text for q, text in got if q == p] == [f"{p}:{i} " for i in range(4)]
    assert len(engine.closed) == num_prompts


@pytest.mark.parametrize("num_prompts", [1, 3])
def test_closing_the_stream_early_closes_every_engine_generator(num_prompts: int) -> None:
    engine = ScriptedEngine(num_outputs=1000)

    async def run() -> None:
        stream = await start(engine, num_prompts)
        await stream.next()
        await stream.aclose()

    asyncio.run(run())
    assert sorted(engine.closed) == (["r"] if num_prompts == 1 else [f"r-{p}" for p in range(num_prompts)])


def test_a_client_leaving_before_the_first_output_cancels_the_request() -> None:
    engine = ScriptedEngine(num_outputs=2, delay=10.0)  # still "queued" when the client leaves

    async def leaves() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def run() -> None:
        await start(engine, 1, leaves)

    with pytest.raises(ClientDisconnected):
        asyncio.run(asyncio.wait_for(run(), 5))
    assert engine.closed == ["r"]


def test_unless_disconnected_returns_the_result_when_work_finishes_first() -> None:
    async def work() -> int:
        return 42

    assert asyncio.run(unless_disconnected(work(), never_disconnects)) == 42


def test_server_config_url_brackets_ipv6() -> None:
    config = ServerConfig(engine=EngineConfig(), host="::1", port=9)
    assert config.url == "http://[::1]:9"
    assert replace(config, host="0.0.0.0").url == "http://0.0.0.0:9"
