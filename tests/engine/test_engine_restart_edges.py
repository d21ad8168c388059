"""The edges of an engine restart, as clients meet them (a real server, its engine in a process of its
own, the official SDKs): a non-streamed request that already had tokens when the engine died gets a
503 with Retry-After in its protocol's shape (OpenAI's on chat, completions and responses,
Anthropic's `overloaded_error` on messages), never a 500, with a log line for each; and a KV-events
new engine's first KV-events batch is AllBlocksCleared (live, or through the replay socket for a
subscriber that reconnected after it)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import orjson
import pytest
import zmq

from engine.cache_events.kv_events import ZmqEventPublisher
from tests import vllm_kv_events as vllm
from tests.engine.test_engine_restart import RESTART_DEADLINE_S, alive, wait_health
from tests.server_utils import HTTP, POLL_S, RunningServer, metric, start_server, wait_for

pytestmark = pytest.mark.slow
MODEL = "tiny"
MAX_TOKENS = 480  # the tiny model's context is 512: long enough to be killed in the middle
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


@pytest.fixture(scope="module")
def server(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, str]]:
    sock = tmp_path_factory.mktemp("kv") / "events.sock"
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{sock}",
        "replay_endpoint": f"ipc://{sock}.replay",
        "topic": "kv-events",
    }
    s = start_server(
        "--model",
        str(qwen3_ckpt),
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "16MiB",
        "--kv-events-config",
        orjson.dumps(events).decode(),
    )
    try:
        yield s, f"ipc://{sock}"
    finally:
        assert s.process.poll() is None, "the HTTP process exited"
        s.stop()


def first_tokens(server: RunningServer) -> float:
    """Samples that had their first token (one TTFT observation each)."""
    text = HTTP.get(server.url("/metrics"), timeout=10).text
    return metric(text, f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="{MODEL}"}}', 0.0)


def requests(server: RunningServer) -> list[Callable[[], Awaitable[Any]]]:
    """One long non-streamed request per route, through its official SDK, retries off."""
    oa = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120)
    an = anthropic.AsyncAnthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
    long = {"ignore_eos": True}
    return [
        lambda: oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "tell a story"}], max_tokens=MAX_TOKENS, extra_body=long
        ),
        lambda: oa.completions.create(model=MODEL, prompt="once upon a time", max_tokens=MAX_TOKENS, extra_body=long),
        # No ignore_eos on these two: greedy, so whether the seeded model stops early is fixed.
        lambda: oa.responses.create(model=MODEL, input="tell a story", max_output_tokens=MAX_TOKENS, temperature=0),
        lambda: an.messages.create(
            model=MODEL,
            max_tokens=MAX_TOKENS,
            extra_body={"temperature": 0},
            messages=[{"role": "user", "content": "tell a story"}],
        ),
    ]


def test_a_non_streamed_request_with_tokens_gets_503_and_retry_after_when_the_engine_dies(
    server: tuple[RunningServer, str],
) -> None:
    running, _ = server
    pid = wait_health(running, "ok", RESTART_DEADLINE_S)["engine_pid"]
    before = first_tokens(running)

    async def scenario() -> list[BaseException | Any]:
        tasks = [asyncio.create_task(make()) for make in requests(running)]
        # Every request has its first token (the engine made output for it), and none has finished.
        deadline = time.monotonic() + 60
        while await asyncio.to_thread(first_tokens, running) < before + len(tasks):
            assert time.monotonic() < deadline, "the requests never started"
            assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
            await asyncio.sleep(POLL_S)
        assert not any(t.done() for t in tasks), "a request finished before the kill: make it longer"
        os.kill(pid, signal.SIGKILL)
        return await asyncio.gather(*tasks, return_exceptions=True)

    outcomes = asyncio.run(scenario())
    for route, outcome in zip(ROUTES, outcomes):
        assert isinstance(outcome, (openai.APIStatusError, anthropic.APIStatusError)), (route, outcome)
        response = outcome.response
        assert response.status_code == 503, (route, response.text)
        assert response.headers["retry-after"] == "2", route
        body = response.json()
        if route == "/v1/messages":
            assert isinstance(outcome, anthropic.ServiceUnavailableError)
            assert body["type"] == "error" and body["error"]["type"] == "overloaded_error", body
            message = body["error"]["message"]
        else:
            assert isinstance(outcome, openai.InternalServerError)
            assert body["error"]["code"] == "engine_restarting" and body["error"]["type"] == "unavailable_error", body
            message = body["error"]["message"]
        assert "was lost" in message and "restarting; retry the request" in message, message
    log = running.log()
    for route in ROUTES:
        assert re.search(
            rf"WARNING fp4serve\.requests: refused POST {re.escape(route)}: 503 key=\S+ code=engine_restarting ", log
        ), route
    wait_health(running, "ok", RESTART_DEADLINE_S)
    assert not alive(pid)


def warm(sub: vllm.Subscriber, client: openai.OpenAI, first_token: int) -> list[Any]:
    """Requests until the subscriber receives a batch: a subscription (or its reconnection to a new
    engine) takes effect a moment after the connection, and PUB drops what it sent before."""
    for i in range(60):
        client.completions.create(model=MODEL, prompt=[first_token + i] + list(range(100, 140)), max_tokens=1)
        if batches := sub.batches(timeout_ms=300):
            return batches
    pytest.fail("the subscriber never received a batch")


def replay(endpoint: str, start: int) -> list[tuple[int, Any]]:
    """The publisher's buffered batches from seq `start`, through its replay socket."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while dealer.poll(30_000):
            _, _, seq, payload = dealer.recv_multipart()
            if seq == ZmqEventPublisher.END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), vllm.decode(payload)))
    finally:
        dealer.close(linger=0)
    raise AssertionError(f"the replay never ended; got {out}")


def test_a_new_engine_announces_all_blocks_cleared_first(server: tuple[RunningServer, str]) -> None:
    running, endpoint = server
    client = running.openai()
    pid = wait_health(running, "ok", RESTART_DEADLINE_S)["engine_pid"]
    sub = vllm.Subscriber(endpoint, "kv-events")
    try:
        warm(sub, client, 7)
        os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda: HTTP.get(running.url("/health"), timeout=5).json()["engine_pid"] not in (None, pid),
            RESTART_DEADLINE_S,
            running.log,
        )
        # The subscription outlives the engine (ZMQ reconnects it to the new one).
        live = [e for batch in warm(sub, client, 200) for e in batch.events]
    finally:
        sub.close()
    assert not any(isinstance(e, vllm.AllBlocksCleared) for e in live[1:]), live
    # The new engine's first batch, sent once it had loaded: a subscriber that reconnected too late
    # for it sees the seq start again at 0 and replays it.
    batches = replay(endpoint + ".replay", 0)
    seq, first = batches[0]
    assert seq == 0 and [type(e).__name__ for e in first.events] == ["AllBlocksCleared"], batches[:3]
    assert any(isinstance(e, vllm.BlockStored) for _, batch in batches[1:] for e in batch.events)
