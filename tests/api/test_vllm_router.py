"""Two `fp4serve serve` replicas behind vllm-router (pip `vllm-router`, the test extra), as a team
that outgrows one box runs them: every request through the router is answered; multi-turn
conversations land on the replica that caches their prefix, both with the router's own text tree
(`--policy cache_aware`) and with fp4serve's KV events (`--policy kv_aware`), counted by each
replica's vllm:prefix_cache_hits_total; a replica SIGKILLed mid-run costs only the requests it held."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.weights.demo_model import ensure_demo_model
from tests.server_utils import HTTP, RunningServer, free_port, start_server

pytestmark = pytest.mark.slow

MODEL = "replica"
NUM_CONVERSATIONS = 8
WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()
# The router takes a dead replica out after its first failed attempt (circuit breaker) or health
# check, and retries the request elsewhere; with its defaults (10 failures, a check a minute) the
# requests right after a kill fail while it retries the dead replica.
FAILOVER_FLAGS = ("--cb-failure-threshold", "1", "--health-check-interval-secs", "1", "--health-failure-threshold", "1")


def router_command() -> str:
    found = shutil.which("vllm-router") or shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    assert found, "vllm-router is not installed: it is in the test extra (pip install -e '.[test]')"
    return found


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[tuple[RunningServer, int]]]:
    """Two replicas, each publishing KV events on its own port (vLLM's empty default topic: the one
    vllm-router's static event sources subscribe to)."""
    ports = [free_port(), free_port()]

    def start(port: int) -> RunningServer:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
        return start_server("--served-model-name", MODEL, "--kv-events-config", orjson.dumps(events).decode())

    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(start, ports))
    try:
        yield list(zip(servers, ports))
    finally:
        for server in servers:
            server.stop()


@contextmanager
def router(replicas: list[tuple[RunningServer, int]], policy: str, *extra: str) -> Iterator[str]:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="vllm-router-", suffix=".log")[1])
    command = [
        router_command(),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--worker-urls",
        *(s.base_url for s, _ in replicas),
        "--policy",
        policy,
        *extra,
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # ready once it proxies /v1/models (it waits for the replicas' health first)
            assert process.poll() is None, f"vllm-router exited:\n{log.read_text(errors='replace')[-3000:]}"
            assert time.monotonic() < deadline, f"vllm-router not ready:\n{log.read_text(errors='replace')[-3000:]}"
            try:
                if HTTP.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.unlink(missing_ok=True)


def prefix_hits(server: RunningServer) -> float:
    text = HTTP.get(server.url("/metrics"), timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:prefix_cache_hits":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("vllm:prefix_cache_hits missing")


def held(server: RunningServer) -> float:
    """Requests the replica holds: running + waiting, by its vLLM-named gauges."""
    text = HTTP.get(server.url("/metrics"), timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
        for s in f.samples
    )


def run_conversations(url: str, servers: list[RunningServer], seed: int) -> None:
    """8 conversations of 3 turns through the router: each opens with a system prompt of its own,
    so a later turn hits a cache only on the replica that served its earlier turns. Asserts that
    those turns find at least 60% of their prompt tokens cached, by the replicas' counters."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    conversations = [
        [{"role": "system", "content": f"Conversation {seed}-{i}. {words(120)}"}] for i in range(NUM_CONVERSATIONS)
    ]

    async def turn(client: openai.AsyncOpenAI, messages: list[dict[str, str]]) -> openai.types.CompletionUsage:
        messages.append({"role": "user", "content": words(25)})
        response = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        assert response.choices[0].message.content is not None
        messages.append({"role": "assistant", "content": response.choices[0].message.content})
        assert response.usage is not None
        return response.usage

    async def run() -> tuple[list[float], list[float], int, int]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            await asyncio.gather(*(turn(client, m) for m in conversations))
            before = [prefix_hits(s) for s in servers]
            prompt = cached = 0
            for _ in range(2):
                for usage in await asyncio.gather(*(turn(client, m) for m in conversations)):
                    prompt += usage.prompt_tokens
                    cached += usage.prompt_tokens_details.cached_tokens
            return before, [prefix_hits(s) for s in servers], prompt, cached

    before, after, prompt_tokens, cached_tokens = asyncio.run(run())
    hits = [b - a for a, b in zip(before, after)]
    assert sum(hits) == cached_tokens  # the replicas' counters say what the clients were told
    assert all(h > 0 for h in hits), f"one replica served no later turn: {hits}"
    assert sum(hits) >= 0.6 * prompt_tokens, (
        f"later turns: {sum(hits)} of {prompt_tokens} prompt tokens cached ({hits})"
    )


def test_cache_aware_router_keeps_conversations_on_their_replica(replicas: list[tuple[RunningServer, int]]) -> None:
    with router(replicas, "cache_aware") as url:
        run_conversations(url, [s for s, _ in replicas], seed=1)


def test_kv_aware_router_routes_on_the_replicas_kv_events(replicas: list[tuple[RunningServer, int]]) -> None:
    servers = [s for s, _ in replicas]
    model_path = str(ensure_demo_model())  # the replicas' model (FP4SERVE_DEFAULT_MODEL): its tokenizer, for the router
    sources = [arg for s, port in replicas for arg in ("--kv-event-source", f"{s.base_url}=tcp://127.0.0.1:{port}")]
    with router(replicas, "kv_aware", *sources, "--kv-event-model", model_path, "--kv-event-block-size", "16") as url:
        run_conversations(url, servers, seed=2)


def test_a_killed_replica_costs_only_the_requests_it_held(replicas: list[tuple[RunningServer, int]]) -> None:
    servers = [s for s, _ in replicas]
    with router(replicas, "cache_aware", *FAILOVER_FLAGS) as url:

        async def run() -> tuple[list[object], float, list[str]]:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            started = 0
            all_started = asyncio.Event()

            async def stream(i: int) -> object:
                nonlocal started
                try:
                    chunks = await client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"stream {i} " * 30}],
                        max_tokens=120,
                        stream=True,
                        extra_body={"ignore_eos": True},
                    )
                    count = 0
                    async for _ in chunks:
                        count += 1
                        if count == 1:
                            started += 1
                            if started == 6:
                                all_started.set()
                    return count
                except openai.APIError as e:
                    return e

            streams = [asyncio.create_task(stream(i)) for i in range(6)]
            await asyncio.wait_for(all_started.wait(), 120)
            holds = [await asyncio.to_thread(held, s) for s in servers]
            victim = max(range(2), key=lambda k: holds[k])
            os.kill(servers[victim].process.pid, signal.SIGKILL)
            after = []
            for i in range(8):
                try:
                    response = await client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"after the kill {i}"}], max_tokens=4
                    )
                    after.append(response.choices[0].finish_reason or "")
                except openai.APIError as e:
                    after.append(repr(e))
            results = await asyncio.gather(*streams)
            await client.close()
            return results, holds[victim], after

        results, victim_held, after = asyncio.run(run())
    failed = [r for r in results if not isinstance(r, int)]
    assert victim_held >= 1, "the kill hit a replica that held no request"
    assert len(failed) <= victim_held, f"{len(failed)} streams failed, the killed replica held {victim_held}: {results}"
    assert all(isinstance(r, int) and r > 1 for r in results if r not in failed)
    assert after == ["length"] * 8, f"requests after the kill: {after}"
