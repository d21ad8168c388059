"""`fp4serve serve --data-parallel-size 2` as its users meet it: a real server whose two engine
cores are processes of their own (each pinned to half the CPUs), the OpenAI SDK, /health and
/metrics.
Concurrent greedy requests are spread over both cores and answer token for token what one core
answers; each core publishes its KV events on its own socket with its rank; a request's n samples
share a core; a conversation's next turn goes to the core holding its prefix although the other
core is idler (per-core prefix hit counters); a core killed with SIGKILL fails only the requests it
held, the other keeps serving, and the lost one restarts."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
import zmq

from scheduler.request import SamplingParams
from tests import vllm_kv_events as vllm
from tests.engine.test_engine_e2e import alone, prompt_for
from tests.engine.test_engine_restart import alive, wait_health
from tests.server_utils import HTTP, RunningServer, metric, start_server

pytestmark = pytest.mark.slow
MODEL = "dp"
RESTART_DEADLINE_S = 90.0
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def events_socket(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv") / "events.sock"


@pytest.fixture(scope="module")
def server(qwen3_ckpt: Path, events_socket: Path) -> Iterator[RunningServer]:
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{events_socket}"}
    s = start_server(
        "--model",
        str(qwen3_ckpt),
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "16MiB",
        "--data-parallel-size",
        "2",
        "--kv-events-config",
        orjson.dumps(events).decode(),
    )
    try:
        yield s
    finally:
        assert s.process.poll() is None, "the HTTP process exited"
        s.stop()


def per_core(server: RunningServer, name: str, **labels: str) -> list[float]:
    """A vLLM-named counter of each engine core."""
    text = HTTP.get(server.url("/metrics"), timeout=10).text
    extra = "".join(f',{k}="{v}"' for k, v in sorted(labels.items()))
    return [metric(text, f'{name}{{engine="{core}"{extra},model_name="{MODEL}"}}', 0.0) for core in ("0", "1")]


def finished(server: RunningServer) -> list[float]:
    return per_core(server, "vllm:request_success_total", finished_reason="length")


def complete(client: openai.OpenAI, prompt: list[int], max_tokens: int, **extra: Any) -> Any:
    return client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0, extra_body={"ignore_eos": True, **extra}
    )


def test_two_engine_processes_serve_greedy_as_one_core_does(
    server: RunningServer, qwen3_ckpt: Path, events_socket: Path
) -> None:
    health = wait_health(server, "ok", 10)
    pids = [core["pid"] for core in health["engines"]]
    assert [core["state"] for core in health["engines"]] == ["running", "running"]
    assert len(set(pids)) == 2 and server.process.pid not in pids and all(alive(pid) for pid in pids)
    cpus = sorted(os.sched_getaffinity(0))  # the server's too: each core pinned to its half
    half = len(cpus) // 2
    for rank in range(2):
        mine = ",".join(map(str, cpus[rank * half : (rank + 1) * half]))
        server.wait_for_log(f"[engine {rank}]: engine core {rank} of 2: CPUs {mine}, {half} torch thread")
    subscribers = [vllm.Subscriber(f"ipc://{events_socket}"), vllm.Subscriber(f"ipc://{events_socket}_dp1")]
    prompts = [prompt_for(i) + list(range(100, 120)) for i in range(8)]  # each at least one full page
    expected = [alone(qwen3_ckpt, p, GREEDY) for p in prompts]
    before = finished(server)

    async def all_at_once() -> list[Any]:
        client = server.async_openai()
        return await asyncio.gather(
            *(
                client.completions.create(
                    model=MODEL,
                    prompt=p,
                    max_tokens=GREEDY.max_tokens,
                    temperature=0.0,
                    extra_body={"ignore_eos": True, "return_token_ids": True},
                )
                for p in prompts
            )
        )

    try:
        answers = asyncio.run(all_at_once())
        assert [token_ids(a) for a in answers] == expected
        after = finished(server)
        served = [a - b for a, b in zip(after, before)]
        assert sum(served) == len(prompts) and min(served) > 0, served
        # Two more at once, one per core, now that the subscriptions are surely in place.
        asyncio.run(two_more(server))
        ranks = [ranks_until_stored(sub) for sub in subscribers]
    finally:
        for sub in subscribers:
            sub.close()
    assert ranks == [{0}, {1}], ranks  # each core on its own socket, its rank in every batch


async def two_more(server: RunningServer) -> None:
    client = server.async_openai()
    await asyncio.gather(
        *(client.completions.create(model=MODEL, prompt=[510 + i] + list(range(1, 40)), max_tokens=2) for i in range(2))
    )


def ranks_until_stored(sub: vllm.Subscriber) -> set[int | None]:
    """The data_parallel_rank of each batch, until one carries a BlockStored."""
    ranks = set()
    while sub.sub.poll(60_000):
        _, _, payload = sub.sub.recv_multipart(zmq.NOBLOCK)
        batch = vllm.decode(payload)
        ranks.add(batch.data_parallel_rank)
        if any(isinstance(e, vllm.BlockStored) for e in batch.events):
            return ranks
    raise AssertionError(f"no BlockStored in 60 s (ranks seen: {ranks})")


def token_ids(answer: Any) -> list[int]:
    """A completion's token ids (vLLM's `return_token_ids`)."""
    return answer.choices[0].model_extra["token_ids"]


def test_the_samples_of_one_request_share_a_core(server: RunningServer) -> None:
    before = finished(server)
    answer = server.openai().completions.create(
        model=MODEL,
        prompt=list(range(1, 42)),
        max_tokens=4,
        n=3,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert len(answer.choices) == 3
    served = sorted(a - b for a, b in zip(finished(server), before))
    assert served == [0, 3]
    assert answer.usage.prompt_tokens_details.cached_tokens == 32  # samples 1, 2 reuse sample 0's pages


def test_metrics_also_serve_each_vllm_series_summed_over_the_cores(server: RunningServer) -> None:
    """The Gateway API Inference Extension's endpoint picker reads engine-less series."""
    text = HTTP.get(server.url("/metrics"), timeout=10).text
    whole = f'{{model_name="{MODEL}"}}'
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prefix_cache_hits_total",
        "vllm:request_success_total",
    ):
        labels = {"finished_reason": "length"} if name == "vllm:request_success_total" else {}
        extra = "".join(f'{k}="{v}",' for k, v in labels.items())
        assert metric(text, f'{name}{{{extra}model_name="{MODEL}"}}') == sum(per_core(server, name, **labels)), name
    # Both cores have the same pages: the whole server's usage is their mean.
    usage = [metric(text, f'vllm:kv_cache_usage_perc{{engine="{core}",model_name="{MODEL}"}}') for core in "01"]
    assert metric(text, f"vllm:kv_cache_usage_perc{whole}") == sum(usage) / 2
    assert (
        metric(text, f"vllm:time_to_first_token_seconds_count{whole}")
        == sum(
            metric(text, f'vllm:time_to_first_token_seconds_count{{engine="{core}",model_name="{MODEL}"}}')
            for core in "01"
        )
        > 0
    )


def test_a_conversations_next_turn_goes_to_the_core_holding_its_prefix(server: RunningServer) -> None:
    client = server.openai()
    opening = prompt_for(40) + list(range(200, 240))
    first = complete(client, opening, 30, return_token_ids=True)  # an idle server: core 0
    hits = per_core(server, "vllm:prefix_cache_hits_total")
    # A long request on core 0 too: core 1 is now the idler one.
    stream = client.completions.create(
        model=MODEL, prompt=list(range(300, 340)), max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    try:
        second = complete(client, opening + token_ids(first) + [7, 8], 4)
    finally:
        stream.close()
    gained = [a - b for a, b in zip(per_core(server, "vllm:prefix_cache_hits_total"), hits)]
    # The first turn computed 51 + 29 tokens, 5 full pages; the second finds all of them, on core 0.
    assert second.usage.prompt_tokens_details.cached_tokens == 80
    assert gained == [80, 0]


def test_a_killed_core_fails_only_its_requests_and_comes_back(server: RunningServer) -> None:
    before = wait_health(server, "ok", RESTART_DEADLINE_S)
    pid = before["engines"][1]["pid"]
    crashes = metric(HTTP.get(server.url("/metrics")).text, 'fp4serve_engine_restarts_total{reason="crash"}', 0.0)

    async def scenario() -> tuple[list[str], dict[str, Any], list[Any]]:
        client = server.async_openai(timeout=120)
        opened = asyncio.Event()
        num_open = 0

        async def one(i: int) -> str:
            nonlocal num_open
            # A first token no earlier test sent: no core has a page of it cached, so the load alone
            # places them, four and four.
            stream = await client.completions.create(
                model=MODEL,
                prompt=[500 + i, *prompt_for(i)],
                max_tokens=200,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            seen, tokens = 0, None
            try:
                async for chunk in stream:
                    seen += 1
                    if seen == 1:
                        num_open += 1
                        if num_open == 8:
                            opened.set()
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
            except openai.APIError as e:
                return e.message
            return f"completed {tokens}"

        streams = [asyncio.create_task(one(i)) for i in range(8)]
        await asyncio.wait_for(opened.wait(), 60)
        os.kill(pid, signal.SIGKILL)
        ended = await asyncio.gather(*streams)
        during = await asyncio.to_thread(lambda: HTTP.get(server.url("/health"), timeout=5).json())
        # Sent while core 1 restarts: core 0 serves them.
        served = await asyncio.gather(
            *(
                client.completions.create(model=MODEL, prompt=[508, i], max_tokens=4, extra_body={"ignore_eos": True})
                for i in range(4)
            )
        )
        return ended, during, served

    ended, during, served = asyncio.run(scenario())
    failed = [message for message in ended if not message.startswith("completed")]
    # The eight spread four and four (each went to the core with fewer in flight).
    assert len(failed) == 4 and all("engine core 1 was lost" in m and "retry" in m for m in failed), ended
    assert [m for m in ended if m not in failed] == ["completed 200"] * 4, ended
    assert all(a.usage.completion_tokens == 4 for a in served)
    if during["engines"][1]["state"] == "restarting":  # it may be back already on a fast machine
        assert during["status"] == "ok" and during["engines"][0]["state"] == "running"
    deadline = time.monotonic() + RESTART_DEADLINE_S
    while (body := HTTP.get(server.url("/health"), timeout=5).json())["engines"][1]["state"] != "running":
        assert time.monotonic() < deadline, body
        time.sleep(0.05)
    assert not alive(pid) and body["engines"][1]["pid"] not in (None, pid) and body["engines"][1]["restarts"] == 1
    assert body["engines"][0]["pid"] == before["engines"][0]["pid"] and body["engines"][0]["restarts"] == 0
    assert body["last_restart"]["engine"] == 1 and body["last_restart"]["reason"] == "crash"
    assert (
        metric(HTTP.get(server.url("/metrics")).text, 'fp4serve_engine_restarts_total{reason="crash"}') == crashes + 1
    )
    # Both cores serve again.
    before_finished = finished(server)

    async def burst() -> list[Any]:
        client = server.async_openai()
        return await asyncio.gather(
            *(client.completions.create(model=MODEL, prompt=[509, i], max_tokens=4) for i in range(6))
        )

    asyncio.run(burst())
    assert all(a > b for a, b in zip(finished(server), before_finished))
