"""A team endpoint as its users meet it: a real server with --api-keys-file and the openai client.
Per-key limits (429 + Retry-After + x-ratelimit-*), /v1/usage, per-key series at /metrics/keys for
admin keys only (none in the open /metrics), SIGHUP reload, the body timeout (over HTTP/2 too), a
client leaving mid-upload, the prompts cap, and Retry-After on the token limit."""

from __future__ import annotations

import hashlib
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.h2_client import H2
from tests.server_utils import RunningServer, metric, start_server, wait_for_metric

pytestmark = pytest.mark.slow
MODEL = "fp4serve-demo-qwen3"
IN_FLIGHT = "fp4serve_http_requests_in_flight"

KEYS = f"""
[[keys]]
name = "alice"
key = "sk-alice-secret"
weight = 2
rpm = 3

[[keys]]
name = "bob"
key_sha256 = "{hashlib.sha256(b"sk-bob-secret").hexdigest()}"
max_concurrent = 1
tpm = 30

[[keys]]
name = "root"
key = "sk-root-secret"
admin = true

[[keys]]
name = "dave"
key = "sk-dave-secret"
tpm = 30
"""


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    return path


@pytest.fixture(scope="module")
def server(keys_file: Path) -> Iterator[RunningServer]:
    s = start_server(
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
        "--api-keys-file",
        str(keys_file),
        "--body-timeout",
        "1",
        "--max-prompts",
        "2",
    )
    try:
        yield s
    finally:
        s.stop()


def client(server: RunningServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=key, max_retries=0)


def complete(c: openai.OpenAI, max_tokens: int = 4) -> openai.types.Completion:
    return c.completions.create(
        model=MODEL, prompt="hello there", max_tokens=max_tokens, extra_body={"ignore_eos": True}
    )


def test_rpm_limit_answers_429_with_openai_headers(server: RunningServer) -> None:
    alice = client(server, "sk-alice-secret")
    for i in range(3):
        raw = alice.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=1)
        assert raw.headers["x-ratelimit-limit-requests"] == "3"
        assert raw.headers["x-ratelimit-remaining-requests"] == str(2 - i)
    with pytest.raises(openai.RateLimitError) as caught:
        complete(alice)
    response = caught.value.response
    assert response.status_code == 429
    assert 1 <= int(response.headers["retry-after"]) <= 60
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    assert response.headers["x-ratelimit-reset-requests"].endswith("s")
    error = response.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert "alice" in error["message"] and "secret" not in error["message"]
    # Another key is not affected.
    assert complete(client(server, "sk-root-secret")).usage.completion_tokens == 4


def test_tpm_and_concurrency_limits(server: RunningServer) -> None:
    bob = client(server, "sk-bob-secret")
    stream = bob.completions.create(
        model=MODEL, prompt="hello", max_tokens=40, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # running: bob's one concurrent slot is taken
    with pytest.raises(openai.RateLimitError) as caught:
        complete(bob)
    assert "concurrent" in caught.value.response.json()["error"]["message"]
    for _ in stream:
        pass
    stream.close()
    # Its slot is free once the server is done with it (the key's limits release before the
    # in-flight gauge drops), and its tokens are counted by then.
    wait_for_metric(server.base_url, IN_FLIGHT, lambda n: n == 0)
    with pytest.raises(openai.RateLimitError) as caught:  # 40+ tokens used of 30 per minute
        complete(bob)
    response = caught.value.response
    assert response.json()["error"]["type"] == "tokens"
    assert response.headers["x-ratelimit-limit-tokens"] == "30"
    assert response.headers["x-ratelimit-remaining-tokens"] == "0"


def test_usage_and_key_labels(server: RunningServer) -> None:
    root = client(server, "sk-root-secret")
    done = complete(root, max_tokens=5)
    with httpx.Client(base_url=server.base_url, timeout=10) as http:
        mine = http.get("/v1/usage", headers={"Authorization": "Bearer sk-bob-secret"}).json()
        everyone = http.get("/v1/usage", headers={"Authorization": "Bearer sk-root-secret"}).json()
        text = http.get("/metrics").text
        per_key = http.get("/metrics/keys", headers={"Authorization": "Bearer sk-root-secret"})
        refused = [
            http.get("/metrics/keys", headers=headers).status_code
            for headers in ({}, {"Authorization": "Bearer sk-nobody"}, {"Authorization": "Bearer sk-bob-secret"})
        ]
        assert http.get("/v1/usage").status_code == 401
        assert http.get("/v1/usage", headers={"Authorization": "Bearer sk-nobody"}).status_code == 401
    # The open /metrics names no key; per-key series are for admin keys only.
    assert "key=" not in text and not any(name in text for name in ("alice", "bob", "root"))
    assert refused == [401, 401, 403]
    assert per_key.status_code == 200
    keyed = per_key.text
    assert [row["key"] for row in mine["data"]] == ["bob"]
    by_key = {row["key"]: row for row in everyone["data"]}
    assert {"alice", "bob", "root"} <= set(by_key)
    assert by_key["root"]["completion_tokens"] >= done.usage.completion_tokens
    assert by_key["root"]["requests"] >= 1 and by_key["root"]["mean_ttft_seconds"] > 0
    for name, row in by_key.items():
        assert metric(keyed, f'fp4serve_generation_tokens_total{{key="{name}"}}', 0) == row["completion_tokens"]
        assert metric(keyed, f'fp4serve_prompt_tokens_total{{key="{name}"}}', 0) == row["prompt_tokens"]
    assert metric(keyed, 'fp4serve_time_to_first_token_seconds_count{key="root"}') == by_key["root"]["requests"]
    # The open series are the sums over keys.
    assert metric(text, "fp4serve_generation_tokens_total") == sum(r["completion_tokens"] for r in by_key.values())
    assert metric(text, 'fp4serve_http_requests_rejected_total{reason="rate_limited"}') >= 1
    log = server.log()
    assert "secret" not in log
    assert "key=root" in log


def test_sighup_reloads_keys(server: RunningServer, keys_file: Path) -> None:
    keys_file.write_text(KEYS + '\n[[keys]]\nname = "carol"\nkey = "sk-carol-secret"\n')
    server.process.send_signal(signal.SIGHUP)
    server.wait_for_log("reloaded 5 API keys")
    assert complete(client(server, "sk-carol-secret")).usage.completion_tokens == 4


def _raw_request(server: RunningServer, body_sent: bytes, declared: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-root-secret\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(declared).encode() + b"\r\n\r\n" + body_sent
    )
    return sock


def test_slow_body_gets_408_and_a_vanishing_client_one_info_line(server: RunningServer) -> None:
    sock = _raw_request(server, b'{"prompt": "hel', 100)
    sock.settimeout(10)  # the server must answer (--body-timeout 1) well before the socket gives up
    reply = b""
    while chunk := sock.recv(4096):  # until the server closes (the 408 says Connection: close)
        reply += chunk
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"request_timeout" in reply

    wait_for_metric(server.base_url, IN_FLIGHT, lambda n: n == 0)
    sock = _raw_request(server, b'{"prompt": "hel', 100)
    wait_for_metric(server.base_url, IN_FLIGHT, lambda n: n == 1)  # the server is reading its body
    sock.close()
    server.wait_for_log("client left while sending the body")
    wait_for_metric(server.base_url, IN_FLIGHT, lambda n: n == 0)  # and it is done with it
    log = server.log()
    assert "Traceback" not in log and "unhandled error" not in log
    # The server still serves.
    assert complete(client(server, "sk-root-secret")).usage.completion_tokens == 4


def test_too_many_prompts_is_a_400(server: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(server, "sk-root-secret").completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=1)
    assert "--max-prompts" in caught.value.response.json()["error"]["message"]


def test_retry_after_on_the_token_limit_is_when_the_key_reopens(server: RunningServer) -> None:
    dave = client(server, "sk-dave-secret")
    complete(dave, max_tokens=40)  # 40 completion tokens of dave's 30 a minute
    used_at = time.monotonic()  # they count from when the request ended, just before this
    with pytest.raises(openai.RateLimitError) as caught:
        complete(dave)
    reopens_at = time.monotonic() + int(caught.value.response.headers["retry-after"])
    assert used_at + 57 <= reopens_at <= used_at + 62, reopens_at - used_at


def test_a_slow_body_over_http2_gets_408_too(server: RunningServer) -> None:
    h2 = H2(server.port)
    try:
        stream_id = h2.start("POST", "/v1/completions", "sk-root-secret", content_length=100)
        h2.send(stream_id, 10)
        response = h2.wait_response(stream_id)
    finally:
        h2.close()
    assert response["status"] == 408 and b"request_timeout" in response["body"]
