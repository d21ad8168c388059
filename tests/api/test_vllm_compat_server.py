"""A real server as routers built for vLLM meet it: /metrics carries vLLM's names, types, labels
and buckets (parsed with prometheus_client's own parser) and they move with the load; with
--kv-events-config a ZMQ subscriber gets BlockStored for a prompt's pages, with vLLM's hashes,
and BlockRemoved once a tiny KV cache reuses them."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.front.vllm_metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from tests import vllm_kv_events as vllm
from tests.server_utils import HTTP, RunningServer, start_server

pytestmark = pytest.mark.slow

MODEL = "compat"
SEED = "7"
BLOCK = 16
# Each family: its type, and the labels every sample carries (histograms: besides `le`).
VLLM_FAMILIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:cache_config_info": "gauge",
    "vllm:lora_requests_info": "gauge",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, str]]:
    sock = tmp_path_factory.mktemp("kv") / "events.sock"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{sock}", "topic": "kv-events"}
    os.environ["PYTHONHASHSEED"] = SEED  # the server inherits it: vLLM's hash seed
    try:
        # 32 pages of 16 tokens: two long requests fit at once, and a few prompts cycle the cache.
        running = start_server(
            "--served-model-name",
            MODEL,
            "--max-num-seqs",
            "2",
            "--kv-cache-memory",
            "1MiB",
            "--kv-events-config",
            orjson.dumps(config).decode(),
        )
    finally:
        del os.environ["PYTHONHASHSEED"]
    try:
        yield running, f"ipc://{sock}"
    finally:
        running.stop()


def scrape(server: RunningServer) -> dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]:
    text = HTTP.get(server.url("/metrics"), timeout=10).text
    return {
        f.name: (f.type, [(s.name, s.labels, s.value) for s in f.samples]) for f in text_string_to_metric_families(text)
    }


def value(families: dict, sample: str, **labels: str) -> float:
    family = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    for name, got, v in families[family][1]:
        if name == sample and labels.items() <= got.items():
            return v
    raise AssertionError(f"no {sample}{labels}")


def complete(server: RunningServer, prompt: list[int] | str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    response = HTTP.post(server.url("/v1/completions"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_metrics_carry_vllms_names_types_labels_and_buckets(server: tuple[RunningServer, str]) -> None:
    running, _ = server
    complete(running, "a first request, so every histogram has an observation", 4)
    families = scrape(running)
    for name, kind in VLLM_FAMILIES.items():
        assert name in families, f"{name} missing from /metrics"
        assert families[name][0] == kind, f"{name}: {families[name][0]}, vLLM's is {kind}"
        for _, labels, _ in families[name][1]:
            if name == "vllm:lora_requests_info":
                assert labels == {"max_lora": "0", "waiting_lora_adapters": "", "running_lora_adapters": ""}
            elif name == "vllm:cache_config_info":
                assert (
                    labels["block_size"] == str(BLOCK) and labels["num_gpu_blocks"] == "32" and labels["engine"] == "0"
                )
            else:
                assert {k: v for k, v in labels.items() if k not in ("le", "finished_reason")} == {
                    "model_name": MODEL,
                    "engine": "0",
                }, f"{name}: {labels}"
    reasons = {
        labels["finished_reason"] for n, labels, _ in families["vllm:request_success"][1] if n.endswith("_total")
    }
    assert reasons == {"stop", "length", "abort", "error"}
    for name, buckets in (
        ("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
        ("vllm:inter_token_latency_seconds", ITL_BUCKETS),
        ("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS),
    ):
        bounds = [float(labels["le"]) for n, labels, _ in families[name][1] if n.endswith("_bucket")]
        assert bounds == [*buckets, float("inf")], name
    assert 0 < value(families, "vllm:lora_requests_info", max_lora="0") <= time.time()  # a timestamp, as vLLM's


def test_counters_move_with_requests_and_a_repeated_prompt_hits_the_cache(server: tuple[RunningServer, str]) -> None:
    running, _ = server
    prompt = list(range(3000, 3000 + 3 * BLOCK + 5))  # 3 full pages and 5 tokens
    before = scrape(running)
    first = complete(running, prompt, 6)
    second = complete(running, prompt, 6)
    after = scrape(running)

    def delta(sample: str, **labels: str) -> float:
        return value(after, sample, **labels) - value(before, sample, **labels)

    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK
    assert delta("vllm:prefix_cache_hits_total") == 3 * BLOCK
    assert delta("vllm:prefix_cache_queries_total") == 2 * len(prompt)
    assert delta("vllm:prompt_tokens_total") == 2 * len(prompt)
    assert delta("vllm:generation_tokens_total") == first["usage"]["completion_tokens"] * 2 == 12
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == delta("vllm:time_per_output_token_seconds_count") == 10
    assert delta("vllm:e2e_request_latency_seconds_count") == delta("vllm:request_decode_time_seconds_count") == 2
    assert delta("vllm:request_prompt_tokens_sum") == 2 * len(prompt)
    # Our own series agree with vLLM's names.
    assert delta("fp4serve_prefix_cache_hits_total") == 3 * BLOCK


def test_running_and_waiting_gauges_follow_the_load(server: tuple[RunningServer, str]) -> None:
    running, _ = server

    async def load() -> list[dict[str, float]]:
        seen: list[dict[str, float]] = []
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"model": MODEL, "max_tokens": 40, "ignore_eos": True}
            requests = [
                asyncio.create_task(client.post(running.url("/v1/completions"), json={**body, "prompt": f"load {i}"}))
                for i in range(4)
            ]
            # --max-num-seqs 2: two run, two wait. Scrape until a scrape shows it (or all finished).
            while not all(r.done() for r in requests):
                families = await asyncio.to_thread(scrape, running)
                seen.append(
                    {
                        k: value(families, k)
                        for k in (
                            "vllm:num_requests_running",
                            "vllm:num_requests_waiting",
                            "vllm:kv_cache_usage_perc",
                            "vllm:gpu_cache_usage_perc",
                        )
                    }
                )
                if seen[-1]["vllm:num_requests_running"] == 2 and seen[-1]["vllm:num_requests_waiting"] >= 1:
                    break
            assert all(r.status_code == 200 for r in await asyncio.gather(*requests))
        return seen

    seen = asyncio.run(load())
    loaded = seen[-1]
    assert loaded["vllm:num_requests_running"] == 2 and loaded["vllm:num_requests_waiting"] >= 1, seen
    assert 0 < loaded["vllm:kv_cache_usage_perc"] == loaded["vllm:gpu_cache_usage_perc"] <= 1
    deadline = time.monotonic() + 30
    while value(idle := scrape(running), "vllm:num_requests_running") or value(idle, "vllm:num_requests_waiting"):
        assert time.monotonic() < deadline, "the gauges did not return to 0 once the load ended"
    assert value(idle, "vllm:kv_cache_usage_perc") == 0


def test_a_subscriber_sees_block_stored_then_block_removed_when_the_cache_reuses_the_pages(
    server: tuple[RunningServer, str],
) -> None:
    running, endpoint = server
    sub = vllm.Subscriber(endpoint, "kv-events")
    try:
        # A subscription takes effect a moment after connect (ZMQ drops earlier batches): warm it up.
        for i in range(30):
            complete(running, list(range(20_000 + 100 * i, 20_000 + 100 * i + BLOCK + 1)), 1)
            if sub.batches(timeout_ms=500):
                break
        else:
            pytest.fail("the subscriber never received a batch")
        prompt = list(range(7000, 7000 + 3 * BLOCK + 3))
        complete(running, prompt, 2)
        expected = vllm.vllm_block_hashes(prompt, BLOCK, SEED)
        events = sub.until(lambda e: isinstance(e, vllm.BlockStored) and e.token_ids[:BLOCK] == prompt[:BLOCK])
        stored = [e for e in events if isinstance(e, vllm.BlockStored) and e.token_ids[:BLOCK] == prompt[:BLOCK]][0]
        assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids) == (
            expected,
            None,
            prompt[: 3 * BLOCK],
        )
        assert (stored.block_size, stored.medium, stored.group_idx) == (BLOCK, "GPU", 0)
        # 32 pages: distinct prompts of 4 pages each reuse the free pages oldest-first, ours among them.
        removed: set[int] = set()
        for i in range(40):
            complete(running, list(range(40_000 + 100 * i, 40_000 + 100 * i + 3 * BLOCK + 3)), 2)
            for batch in sub.batches(timeout_ms=200):
                removed.update(h for e in batch.events if isinstance(e, vllm.BlockRemoved) for h in e.block_hashes)
            if set(expected) <= removed:
                break
        assert set(expected) <= removed, "the prompt's pages were never reported evicted"
        assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs))), "a batch went missing"
    finally:
        sub.close()
