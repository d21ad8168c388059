"""The endpoint heals itself, as its users meet it: a real server (a subprocess, the engine in a
process of its own) and the OpenAI SDK. SIGKILL the engine process under 8 open streams, or
freeze it with SIGSTOP (the watchdog, with a short --engine-step-timeout): every stream ends at
once with an error event, /health says `restarting` (503) and then ok with a new engine pid,
requests sent meanwhile wait and are served, the HTTP process stays up, and per-key usage and
rate limits carry on. Killed over and over, the server backs off and then exits 1 saying why. The
fair-share and cumulative counters cross into the new engine (engine level: they live in the
engine process)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.client.supervisor import EngineSupervisor
from engine.config import EngineConfig
from engine.core_types import Owner
from engine.front.async_engine import AsyncEngine, EngineStats
from scheduler.request import SamplingParams
from tests.server_utils import HTTP, RunningServer, metric, start_server

pytestmark = pytest.mark.slow
MODEL = "fp4serve-demo-qwen3"
STEP_TIMEOUT_S = 3.0
RESTART_DEADLINE_S = 90.0  # the engine reloads the tiny model in seconds; a loaded CI machine is slow
END_DEADLINE_S = 20.0  # from the signal to every stream's end (a hang: the step timeout, then a kill)
NUM_STREAMS = 8
KEYS = """
[[keys]]
name = "alice"
key = "sk-alice"

[[keys]]
name = "carol"
key = "sk-carol"
rpm = 5
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    s = start_server(
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
        "--api-keys-file",
        str(keys),
        "--engine-step-timeout",
        str(STEP_TIMEOUT_S),
    )
    try:
        yield s
    finally:
        assert s.process.poll() is None, "the HTTP process exited"
        s.stop()


def health(server: RunningServer) -> tuple[int, dict[str, Any]]:
    response = HTTP.get(server.url("/health"), timeout=5)
    return response.status_code, response.json()


def wait_health(server: RunningServer, status: str, deadline_s: float) -> dict[str, Any]:
    """Poll /health until its `status` field is `status`; its body."""
    deadline = time.monotonic() + deadline_s
    seen = []
    while time.monotonic() < deadline:
        assert server.process.poll() is None, f"the server exited:\n{server.log()[-3000:]}"
        code, body = health(server)
        if body["status"] == status:
            assert code == (200 if status == "ok" else 503), body
            return body
        seen.append(body["status"])
        time.sleep(0.05)
    raise AssertionError(
        f"/health never said {status!r} in {deadline_s:g} s (saw {seen[-3:]}):\n{server.log()[-3000:]}"
    )


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except FileNotFoundError:
        return False
    return state != "Z"


async def open_streams(client: openai.AsyncOpenAI, count: int) -> tuple[list[asyncio.Task[str]], asyncio.Event]:
    """`count` chat streams; the event is set once every one has its first chunk. Each task returns
    "completed" or the message of the error that ended it."""
    first_chunks = 0
    all_open = asyncio.Event()

    async def one(i: int) -> str:
        nonlocal first_chunks
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"story {i}"}],
            max_tokens=230,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        seen = False
        try:
            async for _ in stream:
                if not seen:
                    seen = True
                    first_chunks += 1
                    if first_chunks == count:
                        all_open.set()
        except openai.APIError as e:
            return e.message
        return "completed"

    return [asyncio.create_task(one(i)) for i in range(count)], all_open


def count_restarts(server: RunningServer, reason: str) -> float:
    return metric(HTTP.get(server.url("/metrics")).text, f'fp4serve_engine_restarts_total{{reason="{reason}"}}', 0.0)


def survive(server: RunningServer, sig: signal.Signals, key: str = "sk-alice") -> dict[str, Any]:
    """Open the streams, signal the engine, and check what every user should see; what happened."""
    before = wait_health(server, "ok", RESTART_DEADLINE_S)
    pid = before["engine_pid"]
    assert alive(pid)

    async def scenario() -> dict[str, Any]:
        client = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key=key, max_retries=0, timeout=120)
        streams, all_open = await open_streams(client, NUM_STREAMS)
        await asyncio.wait_for(all_open.wait(), 60)
        os.kill(pid, sig)
        signalled = time.monotonic()
        if sig == signal.SIGSTOP:
            # Sent to the frozen engine: it never started, so it gets a 503 it may retry.
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as raw:
                refused = await raw.post(
                    "/v1/chat/completions",
                    headers={"Authorization": f"Bearer {key}"},
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                )
        else:
            refused = None
        ended = await asyncio.gather(*streams)
        took = time.monotonic() - signalled
        body = await asyncio.to_thread(wait_health, server, "restarting", 10)
        # Sent during the restart: it waits for the new engine.
        waiting = asyncio.create_task(
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "during"}], max_tokens=4)
        )
        return {
            "ended": ended,
            "took": took,
            "restarting": body,
            "waiting": waiting,
            "refused": refused,
            "client": client,
        }

    async def after(run: dict[str, Any]) -> list[Any]:
        client: openai.AsyncOpenAI = run["client"]
        served = await run["waiting"]
        answers = await asyncio.gather(
            *[
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"next {i}"}], max_tokens=4
                )
                for i in range(16)
            ]
        )
        return [served, *answers]

    loop = asyncio.new_event_loop()
    try:
        run = loop.run_until_complete(scenario())
        after_body = wait_health(server, "ok", RESTART_DEADLINE_S)
        answered = loop.run_until_complete(after(run))
    finally:
        loop.close()
    assert not alive(pid), "the lost engine process is still there"
    assert len(run["ended"]) == NUM_STREAMS and run["took"] < END_DEADLINE_S, run
    for message in run["ended"]:
        assert message == "completed" or "restarting; retry the request" in message, message
    assert any(message != "completed" for message in run["ended"])
    assert run["restarting"]["engine_pid"] is None and "restarting" in run["restarting"]["error"]["message"]
    assert after_body["engine_pid"] not in (None, pid) and alive(after_body["engine_pid"])
    assert after_body["engine_restarts"] == before["engine_restarts"] + 1
    assert all(a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 4 for a in answered)
    return {**run, "pid": pid, "health": after_body}


def test_a_killed_engine_ends_every_stream_and_a_new_one_serves_what_follows(server: RunningServer) -> None:
    crashes = count_restarts(server, "crash")
    run = survive(server, signal.SIGKILL)
    last = run["health"]["last_restart"]
    assert last["reason"] == "crash" and "exit code -9" in last["detail"] and last["duration_s"] > 0
    assert count_restarts(server, "crash") == crashes + 1
    restarted = re.findall(
        r"WARNING fp4serve\.engine: engine core restarted after a crash \(.*exit code -9.*\) in "
        r"[\d.]+ s: restart \d of 5 within 600 s",
        server.log(),
    )
    assert restarted, server.log()[-3000:]


def test_a_frozen_engine_is_killed_by_the_watchdog_and_replaced(server: RunningServer) -> None:
    hangs = count_restarts(server, "hang")
    run = survive(server, signal.SIGSTOP)
    refused = run["refused"]
    assert refused.status_code == 503 and refused.headers["retry-after"] == "2", refused.text
    assert refused.json()["error"]["code"] == "engine_restarting"
    last = run["health"]["last_restart"]
    assert last["reason"] == "hang" and f"batch: {NUM_STREAMS} requests" in last["detail"], last
    assert count_restarts(server, "hang") == hangs + 1
    hang_line = re.search(
        rf"ERROR fp4serve\.engine: engine hang: .*{NUM_STREAMS} requests, .* tokens: \d+ prefills "
        rf"\(\d+ tokens\), \d+ decodes.*killing the engine process {run['pid']}",
        server.log(),
    )
    assert hang_line, server.log()[-3000:]


def test_usage_and_rate_limits_of_a_key_survive_a_restart(server: RunningServer) -> None:
    wait_health(server, "ok", RESTART_DEADLINE_S)
    carol = openai.OpenAI(base_url=server.url("/v1"), api_key="sk-carol", max_retries=0)

    def usage() -> dict[str, Any]:
        response = HTTP.get(server.url("/v1/usage"), headers={"Authorization": "Bearer sk-carol"})
        [row] = [row for row in response.json()["data"] if row["key"] == "carol"]
        return row

    # Two of carol's five requests a minute go to the streams that the kill ends.
    run = survive_with_streams(server, "sk-carol", 2)
    used = usage()
    assert used["total_tokens"] > 0 and used["requests"] == 2
    wait_health(server, "ok", RESTART_DEADLINE_S)
    assert usage() == used  # counted in the server process: the restart lost nothing
    for _ in range(3):
        carol.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert time.monotonic() - run < 55, "the machine was too slow for the 60 s rate window this test relies on"
    with pytest.raises(openai.RateLimitError):
        carol.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert usage()["requests"] == 5


def survive_with_streams(server: RunningServer, key: str, count: int) -> float:
    """`count` streams under `key`, the engine killed under them; when the first request was sent."""
    pid = wait_health(server, "ok", RESTART_DEADLINE_S)["engine_pid"]

    async def scenario() -> float:
        client = openai.AsyncOpenAI(base_url=server.url("/v1"), api_key=key, max_retries=0)
        started = time.monotonic()
        streams, all_open = await open_streams(client, count)
        await asyncio.wait_for(all_open.wait(), 60)
        os.kill(pid, signal.SIGKILL)
        assert all(message != "completed" for message in await asyncio.gather(*streams))
        return started

    return asyncio.run(scenario())


def test_an_engine_that_keeps_dying_makes_the_server_back_off_then_exit_1() -> None:
    server = start_server("--max-model-len", "256", "--kv-cache-memory", "16MiB", "--engine-max-restarts", "2")
    try:
        for _ in range(2):
            pid = wait_health(server, "ok", RESTART_DEADLINE_S)["engine_pid"]
            os.kill(pid, signal.SIGKILL)
            wait_health(server, "restarting", 10)
        pid = wait_health(server, "ok", RESTART_DEADLINE_S)["engine_pid"]
        os.kill(pid, signal.SIGKILL)
        assert server.process.wait(30) == 1
        log = server.log()
        assert "restarting the engine in 1 s" in log and "restarting the engine in 2 s" in log
        assert re.search(
            r"the engine stopped \(the engine process exited \(exit code -9\); that is 3 failures "
            r"within 600 s \(--engine-max-restarts 2, --engine-restart-window 600\): not restarting it "
            r"again\): exiting with status 1",
            log,
        ), log[-3000:]
    finally:
        server.stop()


def test_fair_share_counters_cross_into_the_new_engine(qwen3_ckpt: Path) -> None:
    config = EngineConfig(model=str(qwen3_ckpt), dtype="float32", kv_cache_memory="8MiB", engine_process=True)

    async def main() -> tuple[dict[str, float], dict[str, float], list[EngineStats]]:
        engine = AsyncEngine.from_config(config)
        supervisor = engine.client
        assert isinstance(supervisor, EngineSupervisor)
        await engine.start()
        try:

            async def run(key: str, max_tokens: int) -> None:
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                outputs = engine.generate(list(range(5, 45)), params, f"{key}-{max_tokens}", owner=Owner(key=key))
                async for _ in outputs:
                    pass

            await asyncio.gather(run("a", 40), run("b", 5))
            await run("b", 6)  # the same prompt again: a prefix-cache hit
            before = dict(supervisor.fair_share)
            counted = engine.stats()
            pid = engine.core_status().pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + RESTART_DEADLINE_S
            while (status := engine.core_status()).state != "running" or status.pid == pid:
                assert time.monotonic() < deadline, status
                await asyncio.sleep(0.05)
            await run("c", 3)  # the new engine's report, after its first request
            return before, dict(supervisor.fair_share), [counted, engine.stats()]
        finally:
            await engine.shutdown()

    before, after, (counted, recounted) = asyncio.run(main())
    assert before["a"] > before["b"] > 0
    assert after["a"] == before["a"] and after["b"] == before["b"] and after["c"] > 0
    # The cumulative counters go on from the lost engine's (the metrics take their increments).
    assert counted.prefix_cache_hit_tokens > 0
    assert recounted.prefix_cache_hit_tokens == counted.prefix_cache_hit_tokens  # the prefix cache did not survive
    assert recounted.prefix_cache_queried_tokens == counted.prefix_cache_queried_tokens + 40


def test_an_engine_that_does_not_load_in_time_is_killed_and_the_server_exits_1() -> None:
    # Spawning Python and importing torch alone take longer than this.
    with pytest.raises(RuntimeError, match="server exited with 1") as failed:
        start_server("--max-model-len", "256", "--kv-cache-memory", "16MiB", "--engine-start-timeout", "0.2")
    assert "the engine process did not load in 0.2 s (--engine-start-timeout)" in str(failed.value)
