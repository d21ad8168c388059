"""The vLLM-compatibility server tests of tests/api/test_vllm_compat_server.py (metrics, KV events) with
the host KV tier on (--kv-offloading-size), plus what the tier adds: a subscriber sees a page the
device evicts stored with medium "CPU" under the same vLLM hash, and vLLM's offloading series move."""

from __future__ import annotations

import os
from collections.abc import Iterator

import orjson
import pytest

from tests import vllm_kv_events as vllm
from tests.api.test_vllm_compat_server import (  # noqa: F401  (collected here again, with this module's server)
    BLOCK,
    MODEL,
    SEED,
    complete,
    scrape,
    test_a_subscriber_sees_block_stored_then_block_removed_when_the_cache_reuses_the_pages,
    test_counters_move_with_requests_and_a_repeated_prompt_hits_the_cache,
    test_metrics_carry_vllms_names_types_labels_and_buckets,
    test_running_and_waiting_gauges_follow_the_load,
    value,
)
from tests.server_utils import RunningServer, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, str]]:
    sock = tmp_path_factory.mktemp("kv") / "events.sock"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{sock}", "topic": "kv-events"}
    os.environ["PYTHONHASHSEED"] = SEED
    try:
        running = start_server(
            "--served-model-name",
            MODEL,
            "--max-num-seqs",
            "2",
            "--kv-cache-memory",
            "1MiB",
            "--kv-events-config",
            orjson.dumps(config).decode(),
            "--kv-offloading-size",
            "0.05",
        )
    finally:
        del os.environ["PYTHONHASHSEED"]
    try:
        yield running, f"ipc://{sock}"
    finally:
        running.stop()


def loaded(families: dict) -> float:
    """Bytes copied back from the host tier (0 before the first load makes the series)."""
    try:
        return value(families, "vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU")
    except (AssertionError, KeyError):
        return 0.0


def test_an_evicted_page_is_announced_on_the_cpu_medium_and_served_back(server: tuple[RunningServer, str]) -> None:
    running, endpoint = server
    sub = vllm.Subscriber(endpoint, "kv-events")
    try:
        for i in range(30):  # a subscription takes effect a moment after connect: warm it up
            complete(running, list(range(50_000 + 100 * i, 50_000 + 100 * i + BLOCK + 1)), 1)
            if sub.batches(timeout_ms=500):
                break
        else:
            pytest.fail("the subscriber never received a batch")
        prompt = list(range(9000, 9000 + 3 * BLOCK + 3))
        complete(running, prompt, 2)
        expected = vllm.vllm_block_hashes(prompt, BLOCK, SEED)
        on_cpu: set[int] = set()
        for i in range(40):  # distinct prompts cycle the 32 device pages
            complete(running, list(range(60_000 + 100 * i, 60_000 + 100 * i + 3 * BLOCK + 3)), 2)
            for batch in sub.batches(timeout_ms=200):
                on_cpu.update(
                    h
                    for e in batch.events
                    if isinstance(e, vllm.BlockStored) and e.medium == "CPU"
                    for h in e.block_hashes
                )
            if set(expected) <= on_cpu:
                break
        assert set(expected) <= on_cpu, "the prompt's pages were never announced on the host tier"
        before = scrape(running)
        again = complete(running, prompt, 2)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK
        after = scrape(running)
        assert loaded(after) > loaded(before)
    finally:
        sub.close()
