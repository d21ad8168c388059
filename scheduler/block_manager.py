"""KV pages: ownership by ref count, the prefix cache (chained hashes of full pages), and an
LRU free queue from which freed-but-cached pages are revived on a hit or evicted last-used-first.

    free queue (front = evicted first)          cached: hash -> page
    [p7 p3 p9 ... p2]   <- freed pages appended at the back, a request's last page first,
                           so a prefix's head outlives its tail.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from scheduler.request import Request

# Hash of "no parent": the chain starts from it.
ROOT_HASH = b"fp4serve-prefix-v1"


class PrefixCacheListener(Protocol):
    """What else keys on cached pages (hybrid models' state checkpoints, scheduler/checkpoint_manager.py)."""

    def page_evicted(self, block_hash: bytes) -> None:
        """A cached page is being reused: its hash leaves the cache."""

    def page_wanted(self, block_hash: bytes) -> bool:
        """False: a freed page with this hash is of no use to any later request (evict it first)."""


class HostSpill(Protocol):
    """The host-memory tier (scheduler/host_tier.py), told of each cached page the device evicts."""

    def spill_page(self, block_hash: bytes, device_page: int) -> bool:
        """Keep the page's KV (copied before the step reuses the page); False when it cannot."""

    def page_gone(self, block_hash: bytes) -> None:
        """The page left the device and the host holds no copy."""


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """128-bit chained hash of one full page: collisions are out of reach, so a hit is exact."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class KVCacheEventSink(Protocol):
    """Told of the prefix cache's own decisions, as they happen (engine/cache_events/kv_events.py turns them into
    vLLM's KV-cache events). Absent (None) unless events are on: nothing is recorded then."""

    def blocks_stored(self, request: Request, block_indices: list[int]) -> None:
        """These full pages of `request` (indices into its block table, ascending) entered the cache."""

    def block_removed(self, block_hash: bytes) -> None:
        """The page cached under this hash was evicted (reused for other tokens)."""

    def all_cleared(self) -> None:
        """Every cached hash was forgotten."""

    def host_stored(self, block_hash: bytes) -> None:
        """The host tier (scheduler/host_tier.py) took a copy of the page cached under this hash."""

    def host_removed(self, block_hash: bytes) -> None:
        """The host tier dropped its copy of the page with this hash."""


class BlockManager:
    """Owns `num_blocks` pages of `block_size` tokens. Pure bookkeeping: no tensors."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0, "need at least one page of at least one token"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Pages with ref count 0, in eviction order. OrderedDict: O(1) removal on revival.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.event_sink: KVCacheEventSink | None = None  # set by the engine core when KV events are on
        # Hybrid models: the state checkpoints that pair with cached pages (None: pages stand alone).
        self.listener: PrefixCacheListener | None = None
        self.host: HostSpill | None = None  # --kv-offloading-size: where evicted cached pages go

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        """Pages held by live requests (cached-but-free pages do not count)."""
        return self.num_blocks - len(self.free_queue)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------
    def extend_hashes(self, request: Request, num_tokens: int) -> None:
        """Make `request.block_hashes` cover every full page of its first `num_tokens` tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i > 0 else ROOT_HASH
            hashes.append(hash_block(parent, request.token_slice(i * bs, (i + 1) * bs)))

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Pages holding the longest cached prefix of the request's tokens.

        Capped at `num_tokens - 1` tokens: the last token is always recomputed so that it
        yields logits to sample from. Counts nothing: a request that waits for pages is looked
        up again every step, so the scheduler counts a lookup only when the request is admitted.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self.extend_hashes(request, max_blocks * self.block_size)
        hit: list[int] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    # ---- allocation ----------------------------------------------------------------------
    def allocate(
        self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = (), num_draft_tokens: int = 0
    ) -> bool:
        """Give `request` pages for its computed tokens plus `num_new_tokens` more, plus
        `num_draft_tokens` speculative ones (never offered to the prefix cache: they are not the
        request's tokens; `trim` returns their pages when they are rejected).

        `cached_blocks` (a prefix hit, only for a request that holds no pages yet) are
        taken first. Returns False, changing nothing, when there are not enough free pages.
        """
        assert not cached_blocks or not request.block_table, "a prefix hit only at first schedule"
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        need = (
            self.num_blocks_for(num_computed + num_new_tokens + num_draft_tokens)
            - len(request.block_table)
            - len(cached_blocks)
        )
        # Reviving a free cached page removes it from the pool we allocate the rest from.
        num_revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if need > len(self.free_queue) - num_revived:
            return False
        for b in cached_blocks:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1
        request.block_table.extend(cached_blocks)
        for _ in range(max(need, 0)):
            request.block_table.append(self._pop_free())
        if self.enable_prefix_caching:
            # Only known tokens: async scheduling computes tokens still in flight (placeholders),
            # whose pages are offered once those tokens are read back.
            self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return True

    def _pop_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        assert self.ref_counts[block] == 0, f"page {block} in the free queue is still referenced"
        old = self.block_hash[block]
        if old is not None:  # evict it from the prefix cache
            if self.cached.get(old) == block:
                del self.cached[old]
                # Spilled before the removal is announced: the host's KV event needs the page's hash.
                if self.host is not None and not self.host.spill_page(old, block):
                    self.host.page_gone(old)
                if self.event_sink is not None:
                    self.event_sink.block_removed(old)
                if self.listener is not None:
                    self.listener.page_evicted(old)
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the hashes of the pages that will be full once `num_tokens` are computed.

        NOTE: registered before the step that computes them runs. Safe because each layer
        writes all new K/V of the batch before any attention reads the cache, so a request
        that hits these pages in the same step reads what is being written.
        """
        num_full = min(num_tokens // self.block_size, len(request.block_table))
        self.extend_hashes(request, num_full * self.block_size)
        # Only pages not looked at before: a step's cost must not grow with the context length.
        # (A page skipped as a duplicate stays unregistered even if the copy is evicted later.)
        sink = self.event_sink
        stored: list[int] = []
        for i in range(request.num_registered_blocks, num_full):
            block = request.block_table[i]
            if self.block_hash[block] is not None:
                continue
            h = request.block_hashes[i]
            if h in self.cached:  # the same content already lives in another page
                continue
            self.block_hash[block] = h
            self.cached[h] = block
            if sink is not None:
                stored.append(i)
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)
        if sink is not None and stored:
            sink.blocks_stored(request, stored)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Return the pages past those `num_tokens` tokens need (pages rejected drafts held)."""
        keep = self.num_blocks_for(num_tokens)
        assert keep >= request.num_registered_blocks, f"{request.request_id}: trimming registered pages"
        while len(request.block_table) > keep:
            block = request.block_table.pop()
            assert self.ref_counts[block] == 1 and self.block_hash[block] is None, f"page {block} is shared"
            self.ref_counts[block] = 0
            self.free_queue[block] = None

    def free(self, request: Request) -> None:
        """Drop the request's references; pages that reach 0 join the free queue's back, or its
        front where the listener says no later request can use them."""
        for block in reversed(request.block_table):
            assert self.ref_counts[block] > 0, f"double free of page {block}"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                h = self.block_hash[block]
                if self.listener is not None and (h is None or not self.listener.page_wanted(h)):
                    self.free_queue.move_to_end(block, last=False)
        request.block_table.clear()
        request.num_registered_blocks = 0

    def demote(self, block_hash: bytes) -> None:
        """A cached page no later request can use: if it is free, it is evicted first."""
        block = self.cached.get(block_hash)
        if block is not None and self.ref_counts[block] == 0:
            self.free_queue.move_to_end(block, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after a failed forward left pages undefined)."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        if self.event_sink is not None:
            self.event_sink.all_cleared()

    def check_invariants(self) -> None:
        """Assert the internal bookkeeping is consistent (tests call this)."""
        for b in range(self.num_blocks):
            in_free = b in self.free_queue
            assert (self.ref_counts[b] == 0) == in_free, f"page {b}: ref {self.ref_counts[b]}, free {in_free}"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"page {b} cached under a stale hash"
