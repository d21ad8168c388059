"""A hybrid server's KV events, as a router subscribed to them meets them (a real server with a tiny
hybrid and one DeltaNet state snapshot, the OpenAI SDK, a ZMQ subscriber): a prompt's pages are
announced with its snapshot, and withdrawn when the snapshot goes to another prompt, although they
stay in the prefix cache, since a prefix hit on them could not be used without the state."""

from __future__ import annotations

import os
from collections.abc import Iterator

import orjson
import pytest

from tests import vllm_kv_events as vllm
from tests.engine.test_hybrid_prefix_cache import LAYOUT_27B
from tests.factories import make_hybrid_checkpoint
from tests.server_utils import RunningServer, start_server

pytestmark = pytest.mark.slow
MODEL = "hybrid"
SEED = "0"
BLOCK = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningServer, str]]:
    checkpoint = make_hybrid_checkpoint(tmp_path_factory.mktemp("hybrid_kv_events"), **LAYOUT_27B)
    sock = tmp_path_factory.mktemp("kv") / "events.sock"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{sock}", "topic": "kv-events"}
    os.environ["PYTHONHASHSEED"] = SEED
    try:
        s = start_server(
            "--model",
            str(checkpoint),
            "--served-model-name",
            MODEL,
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "16MiB",
            "--max-model-len",
            "1024",
            "--num-state-checkpoints",
            "1",
            "--kv-events-config",
            orjson.dumps(events).decode(),
        )
    finally:
        del os.environ["PYTHONHASHSEED"]
    try:
        yield s, f"ipc://{sock}"
    finally:
        s.stop()


def announced(batches: list[vllm.KVEventBatch], pages: set[int]) -> set[int]:
    """The pages a router believes cached after these batches, from `pages` before them."""
    pages = set(pages)
    for batch in batches:
        for e in batch.events:
            if isinstance(e, vllm.BlockStored):
                pages.update(e.block_hashes)
            elif isinstance(e, vllm.BlockRemoved):
                pages.difference_update(e.block_hashes)
            elif isinstance(e, vllm.AllBlocksCleared):
                pages.clear()
    return pages


def test_pages_are_withdrawn_when_their_snapshot_goes_although_they_stay_cached(
    server: tuple[RunningServer, str],
) -> None:
    running, endpoint = server
    client = running.openai()
    sub = vllm.Subscriber(endpoint, "kv-events")
    try:
        for i in range(30):  # a subscription takes effect a moment after connect: warm it up
            client.completions.create(model=MODEL, prompt=[300 + i] + list(range(100, 100 + BLOCK)), max_tokens=1)
            if batches := sub.batches(timeout_ms=500):
                break
        else:
            pytest.fail("the subscriber never received a batch")
        seen = announced(batches, set())
        a = list(range(10, 10 + 2 * BLOCK + 1))  # two full pages and a token
        answer = client.completions.create(model=MODEL, prompt=a, max_tokens=1, temperature=0.0)
        seen = announced(sub.batches(timeout_ms=1000), seen)
        a_pages = vllm.vllm_block_hashes(a, BLOCK, SEED)
        assert set(a_pages) <= seen
        # The one snapshot goes to b's prompt: a's pages stay in the cache (it is far from full),
        # but a request sharing them could not use them: a router must not count them.
        b = list(range(200, 200 + BLOCK + 1))
        client.completions.create(model=MODEL, prompt=b, max_tokens=1, temperature=0.0)
        seen = announced(sub.batches(timeout_ms=1000), seen)
    finally:
        sub.close()
    assert seen == set(vllm.vllm_block_hashes(b, BLOCK, SEED)), (len(seen), answer.usage)
    # The cache kept a's pages: the same prompt again finds them, and computes them again all the
    # same (no state snapshot there), which is what the withdrawal said.
    again = client.completions.create(model=MODEL, prompt=a, max_tokens=1, temperature=0.0)
    assert again.usage.prompt_tokens_details is None or not again.usage.prompt_tokens_details.cached_tokens
