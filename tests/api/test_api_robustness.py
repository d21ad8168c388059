"""What keeps a shared endpoint healthy: every class of bad request gets its OpenAI-shaped
4xx (never a 500, never a trace), the API key guards /v1/*, clients that leave are aborted
and their KV pages freed, and concurrent streams share one running batch."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import openai
import pytest

from tests.server_utils import HTTP, RunningServer, running_server

pytestmark = pytest.mark.slow  # real servers in subprocesses: `make test-fast` skips them

MODEL = "fp4serve-demo-qwen3"
KEY = "sk-test-7f3a"
MAX_MODEL_LEN = 128
BODY_LIMIT = 64 * 1024
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server(
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-request-bytes",
        str(BODY_LIMIT),
        "--max-num-seqs",
        "64",
        "--kv-cache-memory",
        "32MiB",
        "--tool-parser",
        "auto",
        "--reasoning-parser",
        "qwen3",
        api_key=KEY,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=server.headers(), timeout=30) as client:
        yield client


def assert_error(response: httpx.Response, status: int, param: str | None = None, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert "Traceback" not in error["message"]
    for word in words:
        assert word in error["message"]
    return error


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_missing_or_wrong_key_is_401_and_probes_stay_open(server: RunningServer) -> None:
    anonymous = HTTP.post(server.url("/v1/chat/completions"), json={"messages": HELLO})
    assert_error(anonymous, 401, None, "API key")
    assert anonymous.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError) as info:
        with openai.OpenAI(base_url=server.url("/v1"), api_key="sk-wrong", max_retries=0) as wrong:
            wrong.models.list()
    assert info.value.code == "invalid_api_key"
    assert HTTP.get(server.url("/v1/models")).status_code == 401
    for open_path in ("/health", "/metrics", "/version"):
        assert HTTP.get(server.url(open_path)).status_code == 200


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": HELLO, "temperature": "warm"}, "temperature", ("number",)),
        ({"messages": HELLO, "top_p": 1.5}, "top_p", ("1.5",)),
        ({"messages": HELLO, "n": 0}, "n", ()),
        ({"messages": HELLO, "max_tokens": -5}, "max_tokens", ("-5",)),
        ({"messages": HELLO, "logit_bias": {"999999999": 5}}, "logit_bias", ("vocabulary",)),
        ({"messages": "hi"}, "messages", ()),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type", ()),
        ({"messages": HELLO, "tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", ()),
    ],
)
def test_bad_chat_parameters_are_400_naming_the_param(
    http: httpx.Client, body: dict[str, Any], param: str, words: tuple[str, ...]
) -> None:
    assert_error(http.post("/v1/chat/completions", json=body), 400, param, *words)


def test_prompt_longer_than_the_context_names_both_numbers(http: httpx.Client) -> None:
    long_prompt = list(range(1000, 1000 + MAX_MODEL_LEN + 5))
    error = assert_error(http.post("/v1/completions", json={"prompt": long_prompt}), 400, "prompt")
    assert str(MAX_MODEL_LEN) in error["message"] and str(MAX_MODEL_LEN + 5) in error["message"]
    long_chat = [{"role": "user", "content": "word " * 300}]
    error = assert_error(
        http.post("/v1/chat/completions", json={"messages": long_chat, "stream": True}), 400, "messages"
    )
    assert str(MAX_MODEL_LEN) in error["message"]
    # max_tokens past the room left is lowered to it under the default --max-tokens-policy clamp; the reject
    # policy's words, with the three numbers, are test_engine_e2e.py's and test_agent_messages.py's.
    clamped = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True})
    assert clamped.status_code == 200, clamped.text
    assert clamped.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 3
    assert clamped.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("content", "words"),
    [(b'{"messages": [', ("not valid JSON",)), (b"[1, 2]", ("JSON object",)), (b"", ("empty",))],
)
def test_malformed_bodies_are_400(http: httpx.Client, content: bytes, words: tuple[str, ...]) -> None:
    assert_error(http.post("/v1/chat/completions", content=content), 400, None, *words)


def test_unknown_model_and_route_are_404(server: RunningServer, http: httpx.Client) -> None:
    with server.openai() as client, pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=HELLO, max_tokens=1)
    assert info.value.code == "model_not_found" and info.value.param == "model"
    assert_error(http.get("/v1/embeddings"), 404, None, "/v1/embeddings")


def test_wrong_method_is_405(http: httpx.Client) -> None:
    assert_error(http.get("/v1/chat/completions"), 405, None, "GET")


def test_oversized_body_is_413_with_or_without_content_length(http: httpx.Client) -> None:
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * BODY_LIMIT + b'"}]}'
    assert_error(http.post("/v1/chat/completions", content=big), 413, None, str(BODY_LIMIT))

    def chunked() -> Iterator[bytes]:  # no Content-Length: the cap must hold while reading
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    assert_error(http.post("/v1/chat/completions", content=chunked()), 413, None, str(BODY_LIMIT))


def test_good_request_is_served_after_a_burst_of_bad_ones(server: RunningServer, http: httpx.Client) -> None:
    bad: list[Any] = [b"{", b"null", {"messages": []}, {"messages": HELLO, "n": "x"}, {"prompt": [-1]}]
    for i in range(40):
        payload = bad[i % len(bad)]
        path = "/v1/completions" if isinstance(payload, dict) and "prompt" in payload else "/v1/chat/completions"
        response = http.post(path, content=payload) if isinstance(payload, bytes) else http.post(path, json=payload)
        assert response.status_code == 400
    with server.openai() as client:
        out = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens >= 1


def test_parsers_chosen_at_start_up_serve_requests_with_tools(server: RunningServer) -> None:
    assert "tool parser qwen3, reasoning parser qwen3" in server.log()  # auto read the chat template
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    with server.openai() as client:
        out = client.chat.completions.create(
            model=MODEL, messages=HELLO, tools=tools, max_tokens=4, extra_body={"enable_thinking": False}
        )
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls") and out.usage.completion_tokens >= 1


def test_clients_that_leave_mid_stream_are_aborted_and_their_pages_freed(
    server: RunningServer, http: httpx.Client
) -> None:
    body = {"messages": HELLO, "max_tokens": 100, "stream": True, "ignore_eos": True}
    with ExitStack() as streams:
        # NOTE: keep each line iterator referenced: a collected httpx iterator closes its connection.
        readers = []
        for _ in range(8):
            response = streams.enter_context(http.stream("POST", "/v1/chat/completions", json=body))
            readers.append(response.iter_lines())
            assert next(line for line in readers[-1] if '"content":' in line and '"role"' not in line)
        running = metric(http.get("/metrics").text, "fp4serve_num_requests_running")
        assert running == 8
        assert metric(http.get("/metrics").text, "fp4serve_kv_cache_usage_ratio") > 0
    deadline = time.monotonic() + 30  # a wait, not a bound: a loaded machine may take a while
    while True:
        text = http.get("/metrics").text
        if metric(text, "fp4serve_num_requests_running") == 0 and metric(text, "fp4serve_kv_cache_usage_ratio") == 0:
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.05)
    assert metric(text, "fp4serve_num_requests_waiting") == 0


def test_32_concurrent_streams_complete_in_shared_batches(server: RunningServer, http: httpx.Client) -> None:
    def big_batches() -> tuple[float, float]:
        text = http.get("/metrics").text
        return metric(text, "fp4serve_batch_size_count"), metric(text, 'fp4serve_batch_size_bucket{le="16.0"}')

    before = big_batches()

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Count to {i}."}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        finish, tokens = "", 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return finish, tokens

    async def all_of_them() -> list[tuple[str, int]]:
        async with server.async_openai(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    assert asyncio.run(all_of_them()) == [("length", 4)] * 32
    after = big_batches()
    # Steps whose batch held more than 16 requests, during this test only.
    assert (after[0] - after[1]) - (before[0] - before[1]) > 0
