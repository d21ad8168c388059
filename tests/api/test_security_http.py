"""The HTTP edge under abuse (issue 32): a request with both Content-Length and Transfer-Encoding is
refused and its connection closed, so a request smuggled in its body never runs; over HTTP/2 an
oversized body gets its 413 at once and the connection goes on; and a client that leaves, over
HTTP/2 too, releases its in-flight count and its key's concurrency slot at once."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import h2.events
import httpx
import orjson
import pytest

from tests.h2_client import H2
from tests.server_utils import HTTP, RunningServer, metric, start_server

pytestmark = pytest.mark.slow
MODEL = "fp4serve-demo-qwen3"
LIMIT = 65536  # --max-request-bytes
GRAMMAR_BUDGET = 1 << 20  # --grammar-cache-bytes
KEYS = """
[[keys]]
name = "alice"
key = "sk-alice"
max_concurrent = 1

[[keys]]
name = "mallory"
key = "sk-mallory"

[[keys]]
name = "root"
key = "sk-root"
admin = true
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    # A body timeout longer than any wait below: what is released, is released by the client leaving.
    s = start_server(
        "--model",
        MODEL,
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
        "--api-keys-file",
        str(keys),
        "--max-request-bytes",
        str(LIMIT),
        "--body-timeout",
        "120",
        "--grammar-cache-bytes",
        f"{GRAMMAR_BUDGET}",
    )
    try:
        yield s
    finally:
        s.stop()


def usage_of(server: RunningServer, key: str) -> dict[str, Any]:
    body = HTTP.get(server.url("/v1/usage"), headers={"Authorization": f"Bearer {key}"}).json()
    [row] = body["data"]
    return row


def wait_for_metric(server: RunningServer, name: str, value: float, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (current := metric(HTTP.get(server.url("/metrics")).text, name)) != value:
        assert time.monotonic() < deadline, f"{name} is {current}, not {value}:\n{server.log()[-3000:]}"
        time.sleep(0.05)


def read_until_closed(sock: socket.socket, timeout_s: float = 30.0) -> bytes:
    sock.settimeout(timeout_s)
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    return reply


# ---- request smuggling (RFC 9112 §6.3) -------------------------------------------------------------
def completion_request(key: str, framing: bytes, body: bytes) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
        + key.encode()
        + b"\r\nContent-Type: application/json\r\n"
        + framing
        + b"\r\n"
        + body
    )


def test_a_request_with_content_length_and_transfer_encoding_is_refused_and_the_smuggled_one_never_runs(
    server: RunningServer,
) -> None:
    inner = orjson.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1})
    smuggled = completion_request("sk-mallory", b"Content-Length: %d\r\n" % len(inner), inner)
    body = b"0\r\n\r\n" + smuggled  # chunked: ends at once; by Content-Length: the smuggled request
    outer = completion_request("sk-root", b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % len(body), body)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(outer)
        reply = read_until_closed(sock)  # the server closes the connection after its one answer
    assert reply.startswith(b"HTTP/1.1 400"), reply
    assert reply.count(b"HTTP/1.1 ") == 1, reply
    assert b'"code":"ambiguous_framing"' in reply and b"connection: close" in reply.lower()
    assert usage_of(server, "sk-mallory")["requests"] == 0
    assert "Content-Length and Transfer-Encoding" in server.log()


def test_a_chunked_request_alone_is_served(server: RunningServer) -> None:
    inner = orjson.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1})
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(inner), inner)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(completion_request("sk-root", b"Transfer-Encoding: chunked\r\nConnection: close\r\n", chunked))
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200"), reply


# ---- HTTP/2 --------------------------------------------------------------------------------------------
def test_http2_body_declared_too_large_gets_413_at_once_and_the_connection_goes_on(server: RunningServer) -> None:
    client = H2(server.port)
    try:
        big = client.start("POST", "/v1/chat/completions", "sk-root", content_length=100_000_000)
        response = client.wait_response(big)  # before any body byte was sent
        assert response["status"] == 413
        assert orjson.loads(response["body"])["error"]["code"] == "request_too_large"
        sent = 0
        while sent < 4 * LIMIT:  # the client goes on sending: the server takes and drops it
            sent += client.send(big, 4 * LIMIT - sent)
            client.pump(0.01)
        models = client.start("GET", "/v1/models", "sk-root", end=True)
        assert client.wait_response(models)["status"] == 200
    finally:
        client.close()
    assert "Traceback" not in server.log()


def test_http2_body_streaming_past_the_limit_gets_413(server: RunningServer) -> None:
    def body() -> Iterator[bytes]:  # no Content-Length: the size shows only as it arrives
        for _ in range(4):
            yield b" " * (LIMIT // 2)

    with httpx.Client(http1=False, http2=True, base_url=server.base_url, timeout=60) as http:
        streamed = http.post("/v1/chat/completions", content=body(), headers={"Authorization": "Bearer sk-root"})
        # Sent without waiting for an answer: more body frames than hypercorn queues for an app
        # that answered without reading them.
        declared = http.post(
            "/v1/chat/completions", content=b" " * (8 * LIMIT), headers={"Authorization": "Bearer sk-root"}
        )
        ok = http.get("/v1/models", headers={"Authorization": "Bearer sk-root"})
    assert streamed.http_version == declared.http_version == "HTTP/2"
    assert streamed.status_code == declared.status_code == 413
    assert streamed.json()["error"]["code"] == declared.json()["error"]["code"] == "request_too_large"
    assert ok.status_code == 200


def test_http2_client_leaving_releases_its_in_flight_count_and_its_key_slot_at_once(server: RunningServer) -> None:
    in_flight = "fp4serve_http_requests_in_flight"
    # Mid-upload (alice may run one request at a time).
    client = H2(server.port)
    stream_id = client.start("POST", "/v1/completions", "sk-alice", content_length=LIMIT - 1)
    client.send(stream_id, 1000)
    wait_for_metric(server, in_flight, 1)
    client.close()
    wait_for_metric(server, in_flight, 0)
    # While a non-streaming completion generates: the 499 the server answers nobody is dropped.
    client = H2(server.port)
    body = orjson.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 200, "ignore_eos": True})
    stream_id = client.start("POST", "/v1/completions", "sk-alice", content_length=len(body))
    client.conn.send_data(stream_id, body, end_stream=True)
    client.flush()
    wait_for_metric(server, "fp4serve_num_requests_running", 1)
    client.close()
    wait_for_metric(server, in_flight, 0)
    wait_for_metric(server, "fp4serve_num_requests_running", 0)
    # Alice's one slot is free again.
    with httpx.Client(http1=False, http2=True, base_url=server.base_url, timeout=60) as http:
        reply = http.post(
            "/v1/completions",
            headers={"Authorization": "Bearer sk-alice"},
            json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
        )
    assert reply.status_code == 200, reply.text
    log = server.log()
    assert "client left while sending the body" in log
    assert "Traceback" not in log


# ---- duplicate credentials --------------------------------------------------------------------------
def test_a_request_naming_two_keys_is_refused_everywhere_a_key_is_read(server: RunningServer) -> None:
    root, mallory = ("authorization", "Bearer sk-root"), ("authorization", "Bearer sk-mallory")
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        created = http.post(
            "/v1/responses",
            headers=[root],
            json={"model": MODEL, "input": "hello", "max_output_tokens": 2, "store": True},
        )
        assert created.status_code == 200, created.text
        path = f"/v1/responses/{created.json()['id']}"
        # Authentication read the first header and the store's owner the last: either order is refused.
        for headers in ([root, mallory], [mallory, root], [root, ("x-api-key", "sk-mallory")]):
            refused = http.get(path, headers=headers)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["code"] == "ambiguous_credentials"
            assert http.delete(path, headers=headers).status_code == 400
        assert http.get(path, headers=[root, root]).status_code == 200  # the same key twice is one key
        assert http.post("/tokenize", headers=[root, mallory], json={"prompt": "hi"}).status_code == 401
    assert "several different credentials" in server.log()


# ---- the grammar budget, as /metrics reports it --------------------------------------------------
def test_compiled_grammars_stay_within_the_budget_across_keys(server: RunningServer) -> None:
    def pick(key: str, salt: str) -> httpx.Response:
        # ~340 KiB compiled each (xgrammar's size, the Qwen vocabulary): three fit the 1 MiB budget, six do not.
        schema = {
            "type": "object",
            "properties": {"v": {"enum": [f"{salt}-{i}" for i in range(4000)]}},
            "required": ["v"],
        }
        return HTTP.post(
            server.url("/v1/chat/completions"),
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "pick"}],
                "max_tokens": 24,
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
            },
        )

    for i, key in enumerate(["sk-root", "sk-mallory"] * 3):
        assert pick(key, f"s{i}").status_code == 200
        text = HTTP.get(server.url("/metrics")).text
        assert metric(text, "fp4serve_grammar_cache_bytes") <= GRAMMAR_BUDGET
    assert metric(text, "fp4serve_grammar_cache_budget_bytes") == GRAMMAR_BUDGET
    assert metric(text, "fp4serve_grammar_cache_misses_total") == 6
    assert metric(text, "fp4serve_grammar_cache_evictions_total") >= 1
    assert metric(text, "fp4serve_grammar_held_bytes") == 0  # the requests ended: nothing held past the cache
    assert "grammar cache: compiled grammars kept up to 1 MiB" in server.log()


def test_http2_connection_lost_while_a_response_waits_for_flow_control_releases_the_request(
    server: RunningServer,
) -> None:
    """A response larger than the client's flow-control window, to a client that stops reading and
    then drops the connection: the send that waited for the window returns, the request ends."""
    in_flight = "fp4serve_http_requests_in_flight"
    wait_for_metric(server, in_flight, 0)
    client = H2(server.port)
    body = orjson.dumps(
        {"model": MODEL, "prompt": "hello " * 200, "max_tokens": 1, "echo": True, "logprobs": 20, "n": 4}
    )  # ~0.5 MB of JSON: far past the 64 KiB window this client never opens
    stream_id = client.start("POST", "/v1/completions", "sk-root", content_length=len(body))
    client.conn.send_data(stream_id, body, end_stream=True)
    client.flush()
    # Take the first window's worth of the response without acknowledging it: the server has more
    # to send and waits for this client to open its window again.
    received, deadline = 0, time.monotonic() + 120
    while received < 65535 - 16384:
        assert time.monotonic() < deadline, f"only {received} bytes of the response came"
        ready, _, _ = select.select([client.sock], [], [], 0.1)
        if ready:
            received += sum(
                len(e.data)
                for e in client.conn.receive_data(client.sock.recv(1 << 16))
                if isinstance(e, h2.events.DataReceived)
            )
            client.flush()
    assert metric(HTTP.get(server.url("/metrics")).text, in_flight) == 1
    client.close()
    wait_for_metric(server, in_flight, 0)
    assert "Traceback" not in server.log()
