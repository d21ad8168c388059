"""SIGTERM as a supervisor sends it to a real `fp4serve serve` process: the stream in flight
completes whole, /health and new requests answer 503 meanwhile (so a load balancer drains the
server), and the process exits 0."""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import httpx
import pytest

from tests.server_utils import DONE, sse_event, start_server

pytestmark = pytest.mark.slow  # real servers in subprocesses: `make test-fast` skips them

MAX_TOKENS = 24


def test_sigterm_mid_stream_lets_the_stream_finish_refuses_new_work_and_exits_0() -> None:
    server = start_server("--max-model-len", "128", "--kv-cache-memory", "32MiB", "--shutdown-timeout", "60")
    body = {
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }

    async def scenario() -> tuple[list[Any], httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = response.aiter_lines()
                events: list[Any] = []
                while not any(e["choices"] and e["choices"][0]["delta"].get("content") for e in events):
                    event = sse_event(await anext(lines))
                    if event is not None:
                        events.append(event)
                server.process.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 10
                while (health := await client.get("/health")).status_code == 200:
                    assert time.monotonic() < deadline, "/health never turned 503"
                    await asyncio.sleep(0.02)
                refused = await client.post("/v1/chat/completions", json={**body, "stream": False})
                events += [e async for line in lines if (e := sse_event(line)) is not None]
            return events, health, refused

    try:
        events, health, refused = asyncio.run(scenario())
        assert health.status_code == 503 and health.json()["status"] == "stopping"
        assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
        assert refused.json()["error"]["code"] == "server_stopping"
        assert not any("error" in e for e in events if isinstance(e, dict))
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        assert events[-2]["usage"]["completion_tokens"] == MAX_TOKENS and events[-1] == DONE
        assert server.process.wait(30) == 0
        assert "SIGTERM: shutting down" in server.log()
    finally:
        server.stop()
