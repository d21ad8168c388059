"""A shared endpoint under a flood and against over-asking clients, as users meet it (a real
`fp4serve serve` subprocess on 127.0.0.1): past the queue bound new requests get 503 with
Retry-After at once while admitted streams finish whole; every per-request limit is a 400
naming the parameter and its flag; the API key never reaches the log; CORS stays off."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server_utils import DONE, HTTP, RunningServer, metric, read_stream, running_server

pytestmark = pytest.mark.slow  # real servers in subprocesses: `make test-fast` skips them

KEY = "sk-robust-5b1e9c0d7a"
MAX_NUM_SEQS = 4
MAX_QUEUED = 4
MAX_OUTPUT_TOKENS = 16
CLIENTS = 32
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with running_server(
        "--max-model-len",
        "128",
        "--kv-cache-memory",
        "32MiB",
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-queued-requests",
        str(MAX_QUEUED),
        "--max-n",
        "4",
        "--max-output-tokens",
        str(MAX_OUTPUT_TOKENS),
        "--max-logprobs",
        "5",
        "--max-stop",
        "2",
        "--max-stop-length",
        "8",
        "--max-tools",
        "2",
        api_key=KEY,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=server.headers(), timeout=60) as client:
        yield client


def test_a_flood_past_the_queue_bound_is_refused_with_retry_after_and_admitted_streams_finish_whole(
    server: RunningServer,
    http: httpx.Client,
) -> None:
    body = {
        "messages": HELLO,
        "max_tokens": 6,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    rejected_metric = 'fp4serve_http_requests_rejected_total{reason="overloaded"}'
    before = metric(http.get("/metrics").text, rejected_metric, default=0.0)

    async def flood() -> list[tuple[int, list[Any], httpx.Headers | None]]:
        async with httpx.AsyncClient(
            base_url=server.base_url,
            headers=server.headers(),
            timeout=120,
            limits=httpx.Limits(max_connections=CLIENTS),
        ) as client:

            async def one() -> tuple[int, list[Any], httpx.Headers | None]:
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    if response.status_code != 200:
                        return response.status_code, [(await response.aread()).decode()], response.headers
                    return 200, [line async for line in response.aiter_lines() if line.startswith("data: ")], None

            return await asyncio.gather(*(one() for _ in range(CLIENTS)))

    results = asyncio.run(flood())
    admitted = [events for status, events, _ in results if status == 200]
    rejected = [(events, headers) for status, events, headers in results if status != 200]
    assert {status for status, _, _ in results} == {200, 503}
    # Every free batch slot and every queue place was used; later arrivals may find room again.
    assert MAX_NUM_SEQS + MAX_QUEUED <= len(admitted) < CLIENTS
    for events in admitted:  # whole: role, 6 tokens, finish, usage, [DONE]; no error event
        assert '"finish_reason":"length"' in events[-3] and '"completion_tokens":6' in events[-2]
        assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    for events, headers in rejected:
        assert headers is not None and headers["retry-after"] == "1"
        assert '"type":"overloaded_error"' in events[0] and '"code":"server_overloaded"' in events[0]
    text = http.get("/metrics").text
    assert metric(text, "fp4serve_num_requests_running") == metric(text, "fp4serve_num_requests_waiting") == 0
    assert metric(text, rejected_metric) - before == len(rejected)


def test_the_sdk_retries_an_overload_honouring_retry_after_and_gets_through(
    server: RunningServer,
    http: httpx.Client,
) -> None:
    rejected = 'fp4serve_http_requests_rejected_total{reason="overloaded"}'
    before = metric(http.get("/metrics").text, rejected, default=0.0)

    async def fill_then_retry() -> tuple[list[Any], list[str]]:
        plain = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=120)
        patient = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=8, timeout=120)

        async def one(client: openai.AsyncOpenAI) -> str:
            out = await client.chat.completions.create(
                model="fp4serve-demo-qwen3", messages=HELLO, max_tokens=8, extra_body={"ignore_eos": True}
            )
            return out.choices[0].finish_reason

        async with plain, patient:
            fillers = [asyncio.create_task(one(plain)) for _ in range(MAX_NUM_SEQS + MAX_QUEUED)]
            while (
                metric((await asyncio.to_thread(http.get, "/metrics")).text, "fp4serve_num_requests_waiting")
                < MAX_QUEUED
            ):
                await asyncio.sleep(0.02)
            retried = await asyncio.gather(*(one(patient) for _ in range(3)))
            return await asyncio.gather(*fillers, return_exceptions=True), list(retried)

    filled, retried = asyncio.run(fill_then_retry())
    assert filled == ["length"] * (MAX_NUM_SEQS + MAX_QUEUED)  # a full queue, every filler admitted
    assert retried == ["length"] * 3
    assert metric(http.get("/metrics").text, rejected) - before >= 3  # each was refused at least once


@pytest.mark.parametrize(
    ("path", "extra", "param", "flag"),
    [
        ("/v1/chat/completions", {"n": 5}, "n", "--max-n"),
        ("/v1/completions", {"n": 5}, "n", "--max-n"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 6}, "top_logprobs", "--max-logprobs"),
        ("/v1/completions", {"logprobs": 6}, "logprobs", "--max-logprobs"),
        ("/v1/chat/completions", {"stop": ["a", "b", "c"]}, "stop", "--max-stop"),
        ("/v1/completions", {"stop_token_ids": [1, 2, 3]}, "stop_token_ids", "--max-stop"),
        ("/v1/chat/completions", {"stop": "123456789"}, "stop", "--max-stop-length"),
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(3)]},
            "tools",
            "--max-tools",
        ),
    ],
)
def test_each_limit_is_a_400_naming_the_parameter_and_the_flag(
    http: httpx.Client,
    path: str,
    extra: dict[str, Any],
    param: str,
    flag: str,
) -> None:
    body = {"messages": HELLO} if path == "/v1/chat/completions" else {"prompt": "Say hello."}
    response = http.post(path, json={**body, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and flag in error["message"]


def test_requests_at_each_limit_are_served(http: httpx.Client) -> None:
    response = http.post(
        "/v1/chat/completions",
        json={
            "messages": HELLO,
            "n": 4,
            "max_tokens": 2,
            "logprobs": True,
            "top_logprobs": 5,
            "stop": ["12345678", "x"],
            "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(2)],
        },
    )
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert all(len(c["logprobs"]["content"][0]["top_logprobs"]) == 5 for c in choices)


def test_an_absent_max_tokens_means_max_output_tokens(server: RunningServer) -> None:
    async def run() -> tuple[int, list[Any]]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers(), timeout=60) as client:
            return await read_stream(
                client,
                "/v1/completions",
                {
                    "prompt": "Once",
                    "stream": True,
                    "ignore_eos": True,
                    "stream_options": {"include_usage": True},
                },
            )

    status, events = asyncio.run(run())
    assert status == 200 and events[-1] == DONE
    assert events[-2]["usage"]["completion_tokens"] == MAX_OUTPUT_TOKENS


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_max_tokens_above_max_output_tokens_is_capped_not_refused(http: httpx.Client, field: str) -> None:
    response = http.post(
        "/v1/chat/completions", json={"messages": HELLO, field: MAX_OUTPUT_TOKENS + 1, "ignore_eos": True}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == MAX_OUTPUT_TOKENS and body["choices"][0]["finish_reason"] == "length"


def test_the_api_key_never_reaches_the_log_and_cors_stays_off(server: RunningServer, http: httpx.Client) -> None:
    wrong = HTTP.post(
        server.url("/v1/chat/completions"), json={"messages": HELLO}, headers={"Authorization": f"Bearer {KEY}-wrong"}
    )
    assert wrong.status_code == 401 and KEY not in wrong.text
    good = http.post(
        "/v1/chat/completions", json={"messages": HELLO, "max_tokens": 1}, headers={"Origin": "https://evil.example"}
    )
    assert good.status_code == 200
    assert not any(h.startswith("access-control-") for h in good.headers)
    preflight = http.options(
        "/v1/chat/completions", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    )
    assert "access-control-allow-origin" not in preflight.headers
    log = server.log()
    assert "API key required" in log and "queue <= 4 requests" in log
    assert KEY not in log


def test_metrics_expose_the_server_process_memory(http: httpx.Client) -> None:
    text = http.get("/metrics").text
    assert 10 << 20 < metric(text, "process_resident_memory_bytes") < 64 << 30
    assert metric(text, "fp4serve_http_requests_in_flight") == 0
