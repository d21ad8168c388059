"""KV-cache events (engine/cache_events/kv_events.py) without a model: the block manager's cache decisions
become vLLM's BlockStored / BlockRemoved / AllBlocksCleared with vLLM's chained block hashes, and
the ZMQ publisher sends them byte for byte as vLLM does, with its replay socket."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import zmq

from engine.cache_events.config import KVEventsConfig
from engine.cache_events.kv_event_hashes import ExternalBlockHashes
from engine.cache_events.kv_events import AllBlocksCleared as OurCleared
from engine.cache_events.kv_events import KVEventRecorder, ZmqEventPublisher
from engine.config import EngineConfig
from engine.errors import ConfigError
from scheduler.block_manager import BlockManager
from scheduler.request import Request, SamplingParams
from tests import vllm_kv_events as vllm
from tests.server_utils import free_port

SEED = "0"
BS = 4


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=None))


def compute(bm: BlockManager, request: Request, cached: list[int] | None = None) -> None:
    """Schedule the rest of the request's tokens in one step (as a prefill does) and compute them."""
    cached = cached or []
    num_new = request.num_tokens - request.num_computed_tokens - len(cached) * bm.block_size
    assert bm.allocate(request, num_new, cached)
    request.num_computed_tokens = request.num_tokens


def with_events(num_blocks: int) -> tuple[BlockManager, KVEventRecorder]:
    bm = BlockManager(num_blocks, BS)
    recorder = KVEventRecorder(BS, ExternalBlockHashes(BS, hash_seed=SEED))
    bm.event_sink = recorder
    return bm, recorder


def as_dicts(events: list[object]) -> list[dict[str, object]]:
    return [{"type": type(e).__name__, **{k: getattr(e, k) for k in e.__struct_fields__}} for e in events]


# ---- the block manager's decisions, as events ---------------------------------------------------------
def test_a_prompt_stores_its_full_pages_with_vllms_chained_hashes() -> None:
    bm, recorder = with_events(8)
    tokens = list(range(100, 110))  # 2 full pages + 2 tokens
    compute(bm, make_request("a", tokens))
    [event] = as_dicts(recorder.take())
    assert event == {
        "type": "BlockStored",
        "block_hashes": vllm.vllm_block_hashes(tokens, BS, SEED),
        "parent_block_hash": None,
        "token_ids": tokens[:8],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "kv_cache_spec_sliding_window": None,
    }
    assert recorder.take() == []  # taken once


def test_decoded_tokens_store_each_page_as_it_fills_chained_on_the_page_before() -> None:
    bm, recorder = with_events(8)
    r = make_request("a", [1, 2, 3, 4, 5, 6])
    compute(bm, r)
    first = recorder.take()
    for token in (7, 8, 9):  # the 8th token fills page 1
        r.output_token_ids.append(token)
        compute(bm, r)
    [stored] = recorder.take()
    expected = vllm.vllm_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS, SEED)
    assert first[0].block_hashes == expected[:1]
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids) == (
        expected[1:],
        expected[0],
        [5, 6, 7, 8],
    )


def test_a_prefix_hit_stores_only_the_new_pages_under_the_cached_parent() -> None:
    bm, recorder = with_events(8)
    shared = [9, 8, 7, 6, 5, 4, 3, 2]
    compute(bm, make_request("a", shared + [1]))
    recorder.take()
    b = make_request("b", shared + [11, 12, 13, 14, 15])
    hit = bm.find_cached_prefix(b)
    assert len(hit) == 2
    compute(bm, b, hit)
    [event] = recorder.take()
    expected = vllm.vllm_block_hashes(shared + [11, 12, 13, 14], BS, SEED)
    assert (event.block_hashes, event.parent_block_hash, event.token_ids) == (
        expected[2:],
        expected[1],
        [11, 12, 13, 14],
    )


def test_reusing_a_cached_page_removes_its_hash_and_a_reset_clears_all() -> None:
    bm, recorder = with_events(3)
    a = make_request("a", list(range(1, 9)))  # 2 pages
    compute(bm, a)
    bm.free(a)  # free but cached: no event (vLLM sends none either)
    stored = recorder.take()
    assert [type(e).__name__ for e in stored] == ["BlockStored"]
    b = make_request("b", list(range(50, 62)))  # 3 pages: takes the free page, then a's two
    compute(bm, b)
    events = as_dicts(recorder.take())
    # a's last page is evicted first (freed pages join the queue's back last-page-first).
    removed = [e["block_hashes"] for e in events if e["type"] == "BlockRemoved"]
    assert removed == [[stored[0].block_hashes[1]], [stored[0].block_hashes[0]]]
    assert events[-1]["type"] == "BlockStored" and events[-1]["token_ids"] == list(range(50, 62))
    bm.reset_prefix_cache()
    assert recorder.take() == [OurCleared()]
    assert len(recorder.hashes) == 0


def test_a_page_whose_content_is_cached_elsewhere_is_not_announced_and_the_chain_holds() -> None:
    bm, recorder = with_events(16)
    tokens = list(range(20, 28))
    a, b = make_request("a", tokens + [1]), make_request("b", tokens + [30, 31])
    compute(bm, a)
    compute(bm, b)  # no prefix lookup: b holds its own copies of a's two pages, announced once
    assert [e.token_ids for e in recorder.take()] == [tokens]
    # a's cached pages are evicted while b still holds its unannounced copies...
    bm.free(a)
    compute(bm, make_request("c", list(range(200, 200 + 13 * BS))))
    assert [len(e.block_hashes) for e in recorder.take()] == [1, 1, 13]  # a's two pages out, c's in
    assert len(recorder.hashes) == 13
    # ...and b's next page still chains on them.
    b.output_token_ids.extend([32, 33])
    compute(bm, b)
    [event] = recorder.take()
    expected = vllm.vllm_block_hashes(tokens + [30, 31, 32, 33], BS, SEED)
    assert (event.block_hashes, event.parent_block_hash, event.token_ids) == (
        expected[2:],
        expected[1],
        [30, 31, 32, 33],
    )


def test_without_a_sink_the_block_manager_records_nothing() -> None:
    bm = BlockManager(4, BS)
    assert bm.event_sink is None
    compute(bm, make_request("a", list(range(1, 9))))
    assert len(bm.cached) == 2


def test_the_hash_seed_comes_from_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    r = make_request("a", [1, 2, 3, 4])
    BlockManager(2, BS).allocate(r, 4)
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert ExternalBlockHashes(BS).store(r, [0]) == vllm.vllm_block_hashes([1, 2, 3, 4], BS, "42")
    monkeypatch.delenv("PYTHONHASHSEED")
    unseeded = [ExternalBlockHashes(BS).store(r, [0]) for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # a random seed per process, as vLLM's


# ---- the publisher -----------------------------------------------------------------------------------------
@pytest.fixture
def endpoints(tmp_path: Path) -> tuple[str, str]:
    return f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/kv-replay.sock"


def test_batches_go_out_as_topic_seq_payload_in_vllms_bytes(endpoints: tuple[str, str]) -> None:
    endpoint, replay = endpoints
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay, topic="kv-events")
    publisher = ZmqEventPublisher(config)
    sub = vllm.Subscriber(endpoint, "kv-events")
    bm, recorder = with_events(8)
    tokens = list(range(1, 9))
    try:
        # PUB/SUB drops what is sent before the subscription arrives: publish until one gets through.
        for _ in itertools.repeat(None, 50):
            compute(bm, make_request("a", tokens))
            bm.reset_prefix_cache()
            publisher.publish(recorder.take())
            if batches := sub.batches(timeout_ms=100):
                break
        [stored, cleared] = batches[0].events
        assert isinstance(stored, vllm.BlockStored) and isinstance(cleared, vllm.AllBlocksCleared)
        assert stored.block_hashes == vllm.vllm_block_hashes(tokens, BS, SEED)
        assert batches[0].data_parallel_rank == 0
        assert sub.seqs == sorted(sub.seqs) and len(set(sub.seqs)) == len(sub.seqs)
        last = sub.seqs[-1]

        # Replay: an 8-byte start seq; every buffered batch from there, then the end marker.
        replayer = zmq.Context.instance().socket(zmq.DEALER)
        replayer.connect(replay)
        replayer.send_multipart([b"", (last - 1 if last else 0).to_bytes(8, "big")])
        frames = []
        while replayer.poll(10_000):
            frames.append(replayer.recv_multipart())
            if frames[-1][2] == ZmqEventPublisher.END_SEQ:
                break
        replayer.close(linger=0)
        assert [f[1] for f in frames[:-1]] == [b"kv-events"] * len(frames[:-1])
        assert [int.from_bytes(f[2], "big") for f in frames[:-1]] == list(range(max(last - 1, 0), last + 1))
        assert frames[-1] == [b"", b"", ZmqEventPublisher.END_SEQ, b""]
        assert vllm.decode(frames[-2][3]).events[0].token_ids == tokens
    finally:
        sub.close()
        publisher.shutdown()


def test_a_taken_endpoint_fails_start_up_with_the_reason() -> None:
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{free_port()}")
    first = ZmqEventPublisher(config)
    try:
        with pytest.raises(ConfigError, match="--kv-events-config: cannot open"):
            ZmqEventPublisher(config)
    finally:
        first.shutdown()


# ---- the flag ------------------------------------------------------------------------------------------------
def test_the_flag_takes_vllms_json_and_defaults() -> None:
    config = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'
    )
    assert config == KVEventsConfig(True, "zmq", "tcp://*:5557", "tcp://*:5558", 10_000, 100_000, 100_000, "kv-events")
    assert config.enabled
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}').enabled  # publisher defaults to zmq
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    assert not KVEventsConfig.from_json("{}").enabled
    assert EngineConfig().kv_events_config is None


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{not json", "invalid JSON"),
        ("[1]", "expected a JSON object"),
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown field 'endpont'"),
        ('{"enable_kv_cache_events": "yes"}', "field 'enable_kv_cache_events' must be bool"),
        ('{"buffer_steps": 0}', "buffer_steps must be positive"),
        ('{"publisher": "kafka"}', "publisher 'kafka' is not one of zmq, null"),
    ],
)
def test_a_bad_flag_value_names_the_field(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        KVEventsConfig.from_json(text)
