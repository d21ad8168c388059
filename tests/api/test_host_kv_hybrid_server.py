"""The hybrid prefix-cache server tests of tests/engine/test_hybrid_prefix_server.py, with the host KV tier
on (--kv-offloading-size), plus what the tier adds: agents' histories evicted from a small device
cache come back from the host, reported in usage.prompt_tokens_details.cached_tokens, /metrics and
/stats."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.test_hybrid_prefix_cache import LAYOUT_27B
from tests.engine.test_hybrid_prefix_server import (  # noqa: F401  (collected here again, with this module's server)
    test_agent_turns_report_their_cached_prompt_through_the_openai_sdk,
    test_users_sharing_an_odd_length_system_prompt_get_it_cached,
    text,
)
from tests.factories import make_hybrid_checkpoint
from tests.server_utils import HTTP, RunningServer, metric, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid_host_kv"), **LAYOUT_27B)


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[RunningServer]:
    """The original tests' server, with the tier on."""
    s = start_server(
        "--model",
        str(checkpoint),
        "--served-model-name",
        "hybrid",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "1024",
        "--kv-offloading-size",
        "0.05",
    )
    try:
        yield s
    finally:
        assert s.stop() == 0


@pytest.fixture(scope="module")
def tight_server(checkpoint: Path) -> Iterator[RunningServer]:
    """512 KiB of device pages and 4 checkpoints hold about two of the histories below; the host all of them."""
    s = start_server(
        "--model",
        str(checkpoint),
        "--served-model-name",
        "hybrid",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "512KiB",
        "--max-model-len",
        "1024",
        "--num-state-checkpoints",
        "4",
        "--kv-offloading-size",
        "0.05",
    )
    try:
        yield s
    finally:
        assert s.stop() == 0


def scraped(server: RunningServer, name: str) -> float:
    return metric(HTTP.get(server.url("/metrics"), timeout=10).text, name, default=0.0)


def chat(server: RunningServer, messages: list[dict[str, str]]) -> tuple[str, int]:
    body = {"model": "hybrid", "messages": messages, "max_tokens": 4, "temperature": 0.0}
    response = HTTP.post(server.url("/v1/chat/completions"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    reply = response.json()
    return reply["choices"][0]["message"]["content"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_histories_evicted_from_the_device_come_back_from_the_host(tight_server: RunningServer) -> None:
    server = tight_server
    conversations = [[{"role": "user", "content": text(300, 500 + i)}] for i in range(6)]
    for messages in conversations:
        answer, cached = chat(server, messages)
        assert cached == 0
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": text(20, 600)}]
    loads_before = scraped(server, "fp4serve_host_kv_page_loads_total")
    # Six 300-token histories, then each again with its answer and a new message: the first ones
    # left the device long ago.
    cached = [chat(server, messages)[1] for messages in conversations]
    assert min(cached) >= 256, cached
    assert scraped(server, "fp4serve_host_kv_page_loads_total") > loads_before
    assert scraped(server, "fp4serve_host_kv_snapshot_loads_total") > 0
    stats = HTTP.get(server.url("/stats"), timeout=10).json()["host_kv"]
    assert stats["hit_tokens"] > 0 and 0 < stats["used_bytes"] <= stats["capacity_bytes"]
