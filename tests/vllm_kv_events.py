"""vLLM's KV-cache event structs as vLLM (v0.26, vllm/distributed/kv_events.py) defines them, and a
ZMQ subscriber like the ones routers run: the tests decode what fp4serve sends with these, so a
field, an order or an encoding option of ours that drifts from vLLM's fails them."""

from __future__ import annotations

import hashlib
from typing import Any

import cbor2
import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def vllm_block_hashes(token_ids: list[int], block_size: int, seed: str) -> list[int]:
    """What vLLM sends for these full pages with `--prefix-caching-hash-algo sha256_cbor` and
    PYTHONHASHSEED=seed, written from its definition (hash_block_tokens, init_none_hash,
    maybe_convert_block_hash), independently of engine/cache_events/kv_event_hashes.py."""

    def sha256_cbor(value: object) -> bytes:
        return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()

    parent, out = sha256_cbor(seed), []
    for i in range(len(token_ids) // block_size):
        parent = sha256_cbor((parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), None))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def decode(payload: bytes) -> KVEventBatch:
    """Decoded with vLLM's structs; asserts the bytes are exactly what vLLM would send for it."""
    batch = DECODER.decode(payload)
    assert msgspec.msgpack.encode(batch) == payload, "not byte for byte vLLM's encoding"
    return batch


class Subscriber:
    """A SUB socket on the publisher's endpoint, as llm-d's indexer or vllm-router subscribe."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.topic = topic.encode()
        self.seqs: list[int] = []

    def batches(self, timeout_ms: int) -> list[KVEventBatch]:
        """Every batch that arrives until none has for `timeout_ms`."""
        out = []
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic
            self.seqs.append(int.from_bytes(seq, "big"))
            out.append(decode(payload))
        return out

    def until(self, predicate: Any, timeout_ms: int = 60_000) -> list[Any]:
        """Events (flattened) until one satisfies `predicate`; fails after `timeout_ms` of silence."""
        events: list[Any] = []
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic
            self.seqs.append(int.from_bytes(seq, "big"))
            events.extend(decode(payload).events)
            if any(predicate(e) for e in events):
                return events
        raise AssertionError(f"no matching event in {timeout_ms} ms; got {events}")

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()
