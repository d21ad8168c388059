"""Faults inside the engine, on a real server run in this process (api.server.Server under
hypercorn, on 127.0.0.1): a failed forward ends every in-flight request with an error and the
next request is served; repeated failures or a crashed step loop make /health 503 and the exit
status 1; --request-timeout and the shutdown timeout end requests with an error and free their
pages. The engine's forward is slowed or broken through a proxy around one shared EngineCore."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from api.app import ServerConfig, build_app
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.front.async_engine import MAX_CONSECUTIVE_FAILURES, AsyncEngine
from engine.model_runner import StepResult
from scheduler.output import SchedulerOutput
from tests.server_utils import DONE, HTTP, InProcessServer, in_process_server, metric, read_stream, start_in_process

ENGINE = EngineConfig(max_model_len=128, kv_cache_memory="32MiB", max_num_seqs=16)
STEP_DELAY_S = 0.05  # added to every forward: a long request takes >= 100 * 50 ms
REQUEST_TIMEOUT_S = 2.0
SHUTDOWN_TIMEOUT_S = 60.0  # what the second-signal test's first signal would wait
SECRET = "CUDA out of memory. Tried to allocate 2.00 GiB at /opt/secret/path"


class FaultyCore:
    """An EngineCore whose forward can be slowed and made to fail, and whose update (run by the
    engine loop outside the forward's error handling) can crash the loop."""

    def __init__(self, core: EngineCore, step_delay_s: float = STEP_DELAY_S) -> None:
        self._core = core
        self.step_delay_s = step_delay_s
        self.crash_processing = False
        self._failures_left = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def fail_next_steps(self, count: int) -> None:
        with self._lock:
            self._failures_left = count

    def execute(self, out: SchedulerOutput) -> StepResult:
        time.sleep(self.step_delay_s)
        with self._lock:
            fail = self._failures_left > 0
            self._failures_left -= fail
        if fail:
            raise RuntimeError(SECRET)
        return self._core.execute(out)

    def update(self, out: SchedulerOutput, result: StepResult) -> Any:
        if self.crash_processing:
            raise KeyError("injected crash in the step loop")
        return self._core.update(out, result)


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return EngineCore(ENGINE)


@pytest.fixture
def faults(core: EngineCore) -> Iterator[FaultyCore]:
    faulty = FaultyCore(core)
    yield faulty
    assert core.scheduler.stats().num_used_blocks == 0, "a test left KV pages held"


def serve(faults: FaultyCore, **config: Any) -> InProcessServer:
    # NOTE: each server wraps the shared core in a fresh AsyncEngine; the model loads once.
    return start_in_process(ServerConfig(engine=ENGINE, **config), loader=lambda _: AsyncEngine(faults))  # type: ignore[arg-type]


def chat(max_tokens: int, stream: bool, content: str = "Tell me a story.") -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
        "temperature": 0,
    }


async def wait_running(client: httpx.AsyncClient, count: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while metric((await client.get("/metrics")).text, "fp4serve_num_requests_running") != count:
        assert time.monotonic() < deadline, f"never saw {count} running requests"
        await asyncio.sleep(0.02)


async def wait_stopping(client: httpx.AsyncClient, timeout: float = 20.0) -> httpx.Response:
    """/health once a graceful shutdown has begun (503, status "stopping")."""
    deadline = time.monotonic() + timeout
    while (health := await client.get("/health")).json().get("status") != "stopping":
        assert time.monotonic() < deadline, f"the server never began stopping: {health.json()}"
        await asyncio.sleep(0.02)
    return health


async def wait_drained(client: httpx.AsyncClient, timeout: float = 5.0) -> str:
    """/metrics once nothing runs, waits, or holds a KV page."""
    deadline = time.monotonic() + timeout
    while True:
        text = (await client.get("/metrics")).text
        if all(
            metric(text, name) == 0
            for name in (
                "fp4serve_num_requests_running",
                "fp4serve_num_requests_waiting",
                "fp4serve_kv_cache_usage_ratio",
            )
        ):
            return text
        assert time.monotonic() < deadline, text
        await asyncio.sleep(0.02)


def content_chunks(events: list[Any]) -> list[str]:
    return [
        e["choices"][0]["delta"]["content"]
        for e in events
        if isinstance(e, dict) and e.get("choices") and e["choices"][0]["delta"].get("content")
    ]


def finish_reasons(events: list[Any]) -> list[str]:
    return [
        e["choices"][0]["finish_reason"]
        for e in events
        if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]
    ]


def error_of(events: list[Any]) -> dict[str, Any]:
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1, events
    assert set(errors[0]) == {"message", "type", "param", "code"}
    return errors[0]


@pytest.fixture(scope="module")
def server(core: EngineCore) -> Iterator[tuple[InProcessServer, FaultyCore]]:
    faulty = FaultyCore(core)
    with in_process_server(
        ServerConfig(engine=ENGINE, request_timeout_s=REQUEST_TIMEOUT_S), loader=lambda _: AsyncEngine(faulty)
    ) as running:  # type: ignore[arg-type]
        yield running, faulty


def test_a_failed_forward_fails_every_in_flight_request_and_the_next_one_is_served(
    server: tuple[InProcessServer, FaultyCore],
) -> None:
    running, faulty = server

    async def scenario() -> tuple[list[list[Any]], httpx.Response, httpx.Response, str]:
        async with httpx.AsyncClient(base_url=running.base_url, timeout=30) as client:
            streams = [
                asyncio.create_task(read_stream(client, "/v1/chat/completions", chat(60, True, f"{i}")))
                for i in range(2)
            ]
            whole = asyncio.create_task(client.post("/v1/chat/completions", json=chat(60, False)))
            await wait_running(client, 3)
            faulty.fail_next_steps(1)
            results = [await s for s in streams]
            assert all(status == 200 for status, _ in results)
            failed = await whole
            metrics = await wait_drained(client)
            after = await client.post("/v1/chat/completions", json=chat(3, False))
            return [events for _, events in results], failed, after, metrics

    streams, failed, after, _ = asyncio.run(scenario())
    for events in streams:
        error = error_of(events)
        assert error["type"] == "server_error" and "RuntimeError" in error["message"]
        assert SECRET not in error["message"]  # the exception text stays in the log
        assert finish_reasons(events) == [] and events[-1] == DONE
    assert failed.status_code == 500
    body = failed.json()["error"]
    assert body["code"] == "engine_error" and "RuntimeError" in body["message"] and SECRET not in body["message"]
    assert after.status_code == 200
    assert after.json()["choices"][0]["finish_reason"] == "length" and after.json()["usage"]["completion_tokens"] == 3
    assert HTTP.get(running.url("/health")).status_code == 200


def test_request_timeout_ends_streamed_and_whole_requests_with_an_error_and_frees_their_pages(
    server: tuple[InProcessServer, FaultyCore],
) -> None:
    running, _ = server

    async def scenario() -> tuple[list[Any], httpx.Response, float, str, str]:
        async with httpx.AsyncClient(base_url=running.base_url, timeout=30) as client:
            before = (await client.get("/metrics")).text
            start = time.monotonic()
            stream = asyncio.create_task(read_stream(client, "/v1/chat/completions", chat(100, True)))
            whole = await client.post("/v1/chat/completions", json=chat(100, False))
            status, events = await stream
            elapsed = time.monotonic() - start
            assert status == 200
            return events, whole, elapsed, before, await wait_drained(client)

    events, whole, elapsed, before, after = asyncio.run(scenario())
    assert elapsed >= REQUEST_TIMEOUT_S
    error = error_of(events)
    assert (error["type"], error["code"]) == ("timeout_error", "request_timeout")
    assert f"{REQUEST_TIMEOUT_S:g} s" in error["message"]
    assert content_chunks(events) and finish_reasons(events) == [] and events[-1] == DONE
    assert whole.status_code == 504 and whole.headers["x-should-retry"] == "false"
    assert whole.json()["error"]["code"] == "request_timeout"
    ended = 'fp4serve_http_requests_ended_early_total{reason="request_timeout"}'
    assert metric(after, ended) - metric(before, ended, default=0.0) == 2


def test_repeated_failures_kill_the_engine_and_health_turns_503(core: EngineCore, faults: FaultyCore) -> None:
    fatal: list[int] = []
    app = build_app(
        ServerConfig(engine=ENGINE),
        loader=lambda _: AsyncEngine(faults),  # type: ignore[arg-type]
        on_fatal=lambda: fatal.append(1),
    )
    faults.fail_next_steps(100)
    with TestClient(app, raise_server_exceptions=False) as client:
        deadline = time.monotonic() + 20
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        statuses = [
            client.post("/v1/chat/completions", json=chat(4, False)).status_code
            for _ in range(MAX_CONSECUTIVE_FAILURES)
        ]
        health = client.get("/health")
        refused = client.post("/v1/chat/completions", json=chat(4, False))
    assert statuses == [500] * MAX_CONSECUTIVE_FAILURES
    assert fatal == [1]
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert f"{MAX_CONSECUTIVE_FAILURES} engine steps failed in a row" in health.json()["error"]["message"]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_failed"


def test_a_dead_engine_makes_the_server_exit_with_status_1(faults: FaultyCore) -> None:
    running = serve(faults)
    faults.fail_next_steps(100)
    try:
        with httpx.Client(base_url=running.base_url, timeout=30) as client:
            for _ in range(MAX_CONSECUTIVE_FAILURES):
                assert client.post("/v1/chat/completions", json=chat(4, False)).status_code in (500, 503)
        assert running.wait_exit(15) == 1
    finally:
        running.stop()


def test_a_crashed_step_loop_ends_in_flight_streams_with_an_error_and_exits_1(faults: FaultyCore) -> None:
    running = serve(faults)

    async def scenario() -> list[Any]:
        async with httpx.AsyncClient(base_url=running.base_url, timeout=30) as client:
            stream = asyncio.create_task(read_stream(client, "/v1/chat/completions", chat(60, True)))
            await wait_running(client, 1)
            faults.crash_processing = True
            status, events = await stream
            assert status == 200
            return events

    try:
        events = asyncio.run(scenario())
        assert error_of(events)["type"] in ("server_error", "unavailable_error")
        assert finish_reasons(events) == [] and events[-1] == DONE
        assert running.wait_exit(15) == 1
    finally:
        running.stop()


def test_shutdown_timeout_ends_a_long_stream_with_an_error_event_and_exits_0(faults: FaultyCore) -> None:
    running = serve(faults, shutdown_timeout_s=1.0)

    async def scenario() -> tuple[list[Any], httpx.Response, httpx.Response, float]:
        async with httpx.AsyncClient(base_url=running.base_url, timeout=30) as client:
            stream = asyncio.create_task(read_stream(client, "/v1/chat/completions", chat(100, True)))
            await wait_running(client, 1)
            start = time.monotonic()
            running.server.stop()
            health = await wait_stopping(client)
            refused = await client.post("/v1/chat/completions", json=chat(2, False))
            status, events = await stream
            assert status == 200
            return events, health, refused, time.monotonic() - start

    try:
        events, health, refused, elapsed = asyncio.run(scenario())
        assert health.status_code == 503 and health.json()["status"] == "stopping"
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_stopping"
        assert refused.headers["retry-after"] == "2"
        assert elapsed >= 1.0  # it waited for the stream up to --shutdown-timeout
        error = error_of(events)
        assert (error["type"], error["code"]) == ("unavailable_error", "server_stopping")
        assert content_chunks(events) and finish_reasons(events) == [] and events[-1] == DONE
        assert running.wait_exit(15) == 0
    finally:
        running.stop()


def test_a_second_stop_signal_ends_in_flight_streams_without_waiting(faults: FaultyCore) -> None:
    running = serve(faults, shutdown_timeout_s=SHUTDOWN_TIMEOUT_S)

    async def scenario() -> tuple[list[Any], float]:
        async with httpx.AsyncClient(base_url=running.base_url, timeout=90) as client:
            stream = asyncio.create_task(read_stream(client, "/v1/chat/completions", chat(100, True)))
            await wait_running(client, 1)
            running.server.stop()
            await wait_stopping(client)
            assert not stream.done()  # the first signal waits for it (up to 60 s)
            start = time.monotonic()
            running.server.stop()
            status, events = await stream
            assert status == 200
            return events, time.monotonic() - start

    try:
        events, elapsed = asyncio.run(scenario())
        # Ended by the second signal, not by the first one's 60 s (a bound no loaded machine nears).
        assert elapsed < SHUTDOWN_TIMEOUT_S / 2
        assert error_of(events)["code"] == "server_stopping" and events[-1] == DONE
        assert finish_reasons(events) == []
        assert running.wait_exit(15) == 0
    finally:
        running.stop()
