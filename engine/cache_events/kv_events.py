"""KV-cache events in vLLM's wire format (`--kv-events-config`), for routers that track what each
replica caches (llm-d's KV-cache indexer, vllm-router's kv_aware policy):

    block manager --(sink calls, in the step)--> KVEventRecorder --(one batch per step)--> ZmqEventPublisher
    (BlockStored when a full page is hashed into           vLLM's block hashes       thread: PUB [topic, seq, payload],
     the prefix cache, BlockRemoved when a cached                                     ROUTER replay from seq N
     page is reused, AllBlocksCleared on a reset;
     medium "CPU" when the host tier takes or drops one)

The structs are vLLM's (vllm/distributed/kv_events.py since its map-encoding change, v0.26): the
batch is a positional array [ts, events, data_parallel_rank], each event a msgpack map tagged by
"type". Hashes are vLLM's `sha256_cbor` chain, not the scheduler's own (engine/cache_events/kv_event_hashes.py).
Nothing here runs unless events are on; the engine core imports it only then.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec

from engine.cache_events.config import KVEventsConfig
from engine.cache_events.kv_event_hashes import ExternalBlockHashes
from engine.errors import ConfigError
from scheduler.request import Request

logger = logging.getLogger("fp4serve.engine")

MEDIUM_GPU = "GPU"  # vLLM's name for the accelerator's KV pool (llm-d's "gpu" tier), whatever the device
MEDIUM_CPU = "CPU"  # vLLM's name for its CPU offloading tier: our host tier (--kv-offloading-size)
FULL_ATTENTION = "full_attention"  # vLLM's kv_cache_spec_kind for a plain paged KV cache group


# ---- the wire structs (field names, order, defaults and struct options as vLLM's) ---------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One event, encoded as a map with its class name under "type"."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
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
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# ---- the block manager's sink ---------------------------------------------------------------------
class KVEventRecorder:
    """scheduler/block_manager.py's `KVCacheEventSink`: turns its cache decisions into events, in
    order, until the core takes them at the end of the step. Runs on the engine's step thread."""

    def __init__(self, block_size: int, hashes: ExternalBlockHashes) -> None:
        self.block_size = block_size
        self.hashes = hashes
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []

    def blocks_stored(self, request: Request, block_indices: list[int]) -> None:
        # One BlockStored per run of consecutive pages, as vLLM sends one per cache_full_blocks call:
        # within an event each hash chains on the one before it. A gap is a page the block manager
        # skipped (its content is cached in another page already).
        bs = self.block_size
        # Consecutive indices share index - position.
        for _, group in itertools.groupby(enumerate(block_indices), key=lambda p: p[1] - p[0]):
            run = [i for _, i in group]
            parent = self.hashes.parent_of(request, run[0])
            tokens = request.token_slice(run[0] * bs, (run[-1] + 1) * bs)
            self.stored(self.hashes.store(request, run), parent, list(tokens))

    def stored(self, block_hashes: list[int], parent: int | None, token_ids: list[int]) -> None:
        """BlockStored of consecutive pages (wire hashes, each chained on the one before it)."""
        self._events.append(
            BlockStored(
                block_hashes=block_hashes,
                parent_block_hash=parent,
                token_ids=token_ids,
                block_size=self.block_size,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=None,
                extra_keys=[None] * len(block_hashes),
                group_idx=0,
                kv_cache_spec_kind=FULL_ATTENTION,
            )
        )

    def block_removed(self, block_hash: bytes) -> None:
        self.removed([self.hashes.remove(block_hash)])

    def removed(self, block_hashes: list[int]) -> None:
        """BlockRemoved of these pages (wire hashes)."""
        self._events.append(BlockRemoved(block_hashes=block_hashes, medium=MEDIUM_GPU, group_idx=0))

    def host_stored(self, block_hash: bytes) -> None:
        # As vLLM's offloading connector announces a stored block: the hash alone, no tokens or parent.
        self._events.append(
            BlockStored(
                block_hashes=[self.hashes.offload(block_hash)],
                parent_block_hash=None,
                token_ids=[],
                block_size=self.block_size,
                lora_id=None,
                medium=MEDIUM_CPU,
                lora_name=None,
            )
        )

    def host_removed(self, block_hash: bytes) -> None:
        self._events.append(BlockRemoved(block_hashes=[self.hashes.drop_offloaded(block_hash)], medium=MEDIUM_CPU))

    def all_cleared(self) -> None:
        self.hashes.clear()
        self._events.append(AllBlocksCleared())

    def take(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        events, self._events = self._events, []
        return events


# ---- the publisher ----------------------------------------------------------------------------------
def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or a local transport is bound; an address is connected to (llm-d's
    older guides bind in the router and point every model server at it)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket [topic, seq (8 bytes, big-endian), msgpack batch] and an optional ROUTER replay
    socket (a client sends an 8-byte start seq; it gets [topic, seq, payload] for every buffered
    batch from there, then [b"", -1, b""]), served by one thread: sockets never cross threads
    after start-up. Sockets are bound here, so a taken port fails start-up, not the first step."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)
    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq  # only with events on

        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._num_dropped = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = self._ctx.socket(zmq.ROUTER) if config.replay_endpoint else None
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if self._replay is not None:
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            where = config.endpoint + (f" / {config.replay_endpoint}" if config.replay_endpoint else "")
            raise ConfigError(f"--kv-events-config: cannot open {where} ({e})") from None
        self._thread = threading.Thread(target=self._run, name="fp4serve-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        """Queue one step's events; never blocks the step (a full queue drops the batch, logged)."""
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._num_dropped += 1
            if self._num_dropped & (self._num_dropped - 1) == 0:  # 1, 2, 4, ...: the log stays readable
                logger.warning(
                    "KV events: the publisher queue is full (%d batches); %d batches dropped so far",
                    self.config.max_queue_size,
                    self._num_dropped,
                )

    def shutdown(self) -> None:
        """Send what is queued (for up to SHUTDOWN_TIMEOUT_S), then close the sockets."""
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(self.SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop in %.0f s", self.SHUTDOWN_TIMEOUT_S)
            return  # its sockets are still in use; the process exit closes them
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:
                logger.exception("KV events: could not send batch %d", seq)
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: replay request of %d frames ignored (want [id, b'', start seq])", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", self.END_SEQ, b""))


class KVEvents:
    """What the engine core holds when events are on: the block manager's sink and the publisher."""

    def __init__(self, config: KVEventsConfig, block_size: int, data_parallel_rank: int = 0) -> None:
        self.hashes = ExternalBlockHashes(block_size)
        self.recorder = KVEventRecorder(block_size, self.hashes)
        self.publisher = ZmqEventPublisher(config, data_parallel_rank)
        replay = f", replay at {config.replay_endpoint}" if config.replay_endpoint else ""
        logger.info(
            "KV events: publishing to %s (%s, topic %r)%s; block hashes: %s",
            config.endpoint,
            "bound" if _binds(config.endpoint) else "connected",
            config.topic,
            replay,
            self.hashes.describe(),
        )

    def started(self) -> None:
        """The engine has loaded and its cache is empty: AllBlocksCleared, so a router that tracked
        the engine this one replaces (a restart, or an earlier server at this endpoint) forgets its
        pages. Sent after the load, not at bind: a subscriber of the lost engine reconnects by then,
        and PUB drops what it sends before that."""
        self.recorder.all_cleared()
        self.flush()

    def flush(self) -> None:
        """Publish what the step recorded (nothing when it recorded nothing)."""
        events = self.recorder.take()
        if events:
            self.publisher.publish(events)

    def shutdown(self) -> None:
        self.flush()
        self.publisher.shutdown()
