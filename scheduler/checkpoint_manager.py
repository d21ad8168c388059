"""State checkpoints of hybrid models (Qwen3.5/3.6) as bookkeeping: which checkpoint ids hold a
sequence's Gated DeltaNet state after which prefix, in LRU order, tied to the KV pages they pair
with. The tensors and copies live in engine/attention/checkpoint_pool.py; this module imports no torch.

A checkpoint holds the state (conv + recurrent, every DeltaNet layer) after a sequence's first
`num_tokens` tokens and, when those end inside a page, a copy of that partial page's KV. It is keyed
by the prefix cache's chained hash of its full pages and the tokens of its partial page, so a
request restores it only when its own tokens are the same, and only while every one of those full
pages is still cached:

    request pages   [h0][h1][h2][h3][h4 ...
    prefix cache     h0  h1  h2  h3            (block_manager: 4 pages hit)
    checkpoints          ^a      ^b  ^c+tail   a: 2 pages; b: 3 pages; c: 4 pages + 5 tokens
    restore c if the request's tokens after h3 start with c's tail, else b; compute the rest.

Pairing with the pages: a page whose hash leaves the cache drops every checkpoint that needs it,
and a freed page that no checkpoint needs is evicted first (`page_wanted`), as are the pages a
dropped checkpoint alone needed (`BlockManager.demote`).

Lifecycle of an entry: PENDING (written by this step's forward; not restorable until the step ran),
QUEUED (written at the start of the next step, before any restore: restorable now), READY. Only READY
entries are evicted. Two LRU segments: snapshots taken on the grid inside long prefills wait in
`probation` and go first; prompt ends, sequence ends, shared-prefix junctions, preemptions and
every checkpoint that was restored once live in `protected`. With a host tier (scheduler/host_tier.py),
a written checkpoint dropped to make room or for a page the device evicted spills there.
"""

from __future__ import annotations

import enum
import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from scheduler.block_manager import ROOT_HASH, BlockManager
from scheduler.host_tier import HostTier
from scheduler.output import CheckpointSave, StateSave
from scheduler.request import Request

MAX_GRID_BITS = 6  # spacing 1/32 of the position: denser grids only cost checkpoints
# The automatic grid stops at spacing 1/16 (any shared prefix restores >= 94% of its full pages): a
# denser one costs measurably more on CPU (docs/PERF.md "Hybrid prefix caching").
AUTO_GRID_BITS = 5


def on_grid(num_pages: int, bits: int) -> bool:
    """Whether a snapshot is taken after `num_pages` full pages of a prefill: page counts with at most
    `bits` significant binary digits (1, 2, 3, 4, 6, 8, 12, 16, 24, ... for 2 bits), so grid points
    are at most 2^(1 - bits) of their position apart and any prefix restores at least
    1 / (1 + 2^(1 - bits)) of its full pages. 0 bits: no grid."""
    if bits <= 0 or num_pages <= 0:
        return False
    drop = num_pages.bit_length() - bits
    return drop <= 0 or num_pages & ((1 << drop) - 1) == 0


def grid_bits_for(max_pages: int, budget: int) -> int:
    """The densest grid (most bits, up to AUTO_GRID_BITS) whose points in `max_pages` fit in `budget`."""
    for bits in range(AUTO_GRID_BITS, 0, -1):
        if sum(on_grid(n, bits) for n in range(1, max_pages + 1)) <= budget:
            return bits
    return 0


class CheckpointState(enum.Enum):
    PENDING = "pending"
    QUEUED = "queued"
    READY = "ready"


@dataclass(eq=False)
class Checkpoint:
    checkpoint_id: int
    chain: tuple[bytes, ...]  # hashes of its full pages, in order: the KV it needs from the prefix cache
    tail: tuple[int, ...]  # tokens after the last full page (their KV is kept with the checkpoint)
    state: CheckpointState
    protected: bool

    @property
    def parent(self) -> bytes:
        return self.chain[-1] if self.chain else ROOT_HASH

    @property
    def num_pages(self) -> int:
        return len(self.chain)


class SnapshotPageSink(Protocol):
    """Told when a cached page starts or stops being needed by a checkpoint: a prefix hit on a
    hybrid reaches only as far as a snapshot's pages, so routers are told of those pages alone
    (engine/cache_events/snapshot_gate.py). Absent (None) unless KV events are on."""

    def pages_kept(self, block_hashes: list[bytes]) -> None:
        """These pages (a chain's, in order) are now needed by a checkpoint; none was before."""

    def pages_released(self, block_hashes: list[bytes]) -> None:
        """No checkpoint needs these pages any more."""


class CheckpointManager:
    def __init__(self, num_checkpoints: int, blocks: BlockManager, grid_bits: int) -> None:
        assert num_checkpoints > 0, "need at least one checkpoint"
        self.num_checkpoints = num_checkpoints
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.grid_bits = grid_bits
        self._free = list(range(num_checkpoints))  # a min-heap: predictable ids in tests
        self._by_parent: dict[bytes, dict[tuple[int, ...], Checkpoint]] = {}
        self._users: dict[bytes, set[Checkpoint]] = {}  # page hash -> the checkpoints that need it
        # LRU segments, least recently used first.
        self._probation: OrderedDict[Checkpoint, None] = OrderedDict()
        self._protected: OrderedDict[Checkpoint, None] = OrderedDict()
        self._queued: list[tuple[Checkpoint, StateSave]] = []
        self._pending: dict[int, Checkpoint] = {}  # by id: written by the step being scheduled
        self.num_saved = 0  # cumulative: checkpoints reserved
        self.num_restored = 0  # cumulative: hits
        self.num_evicted = 0  # cumulative: dropped to make room
        self.num_invalidated = 0  # cumulative: dropped because a page they needed was evicted
        self.host: HostTier | None = None  # --kv-offloading-size: where dropped checkpoints spill
        self.page_sink: SnapshotPageSink | None = None  # set by the engine core when KV events are on
        blocks.listener = self

    # ---- queries -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_checkpoints - len(self._free)

    def find(self, request: Request, num_cached_pages: int) -> Checkpoint | None:
        """The restorable checkpoint at the longest prefix of the request's tokens whose full pages
        are among its `num_cached_pages` leading cached pages; capped at `num_tokens - 1` tokens, so
        the last token yields logits. Counts nothing (a waiting request is looked up every step)."""
        bs = self.block_size
        limit = request.num_tokens - 1
        hashes = request.block_hashes
        for i in range(min(num_cached_pages, limit // bs), -1, -1):
            group = self._by_parent.get(hashes[i - 1] if i else ROOT_HASH)
            if not group:
                continue
            best: Checkpoint | None = None
            for tail, ck in group.items():
                end = i * bs + len(tail)
                if ck.state is CheckpointState.PENDING or end == 0 or end > limit:
                    continue
                if best is not None and len(tail) <= len(best.tail):
                    continue
                if tail and tuple(request.token_slice(i * bs, end)) != tail:
                    continue
                best = ck
            if best is not None:
                return best
        return None

    def save_points(self, request: Request, start: int, end: int) -> list[tuple[int, bool]]:
        """(position, protected) of the snapshots a chunk computing tokens [start, end) takes: grid
        page counts, the request's shared-prefix junction, and its prompt's end."""
        bs = self.block_size
        points = {
            pages * bs: False for pages in range(start // bs + 1, end // bs + 1) if on_grid(pages, self.grid_bits)
        }
        if start < request.checkpoint_junction <= end:
            points[request.checkpoint_junction] = True
        if end == request.num_prompt_tokens:
            points[end] = True
        return sorted(points.items())

    # ---- the scheduler's calls ----------------------------------------------------------------------
    def restore_point(self, request: Request, hit: list[int], num_host_pages: int = 0) -> tuple[Checkpoint | None, int]:
        """For a request about to start, with `hit` its leading cached pages and `num_host_pages`
        more in the host tier: the checkpoint to restore (None: start from scratch) and the tokens it
        covers. Sets the request's junction where its cached pages reach past that checkpoint."""
        ck = self.find(request, len(hit))
        num_tokens = 0 if ck is None else ck.num_pages * self.block_size + len(ck.tail)
        reach = (len(hit) + num_host_pages) * self.block_size
        request.checkpoint_junction = reach if reach > num_tokens else 0
        return ck, num_tokens

    def saves_for(self, request: Request, start: int, end: int) -> tuple[CheckpointSave, ...]:
        """Reserve this step's snapshots of a request computing tokens [start, end) (no drafts)."""
        saves = []
        for position, protected in self.save_points(request, start, end):
            checkpoint_id = self.reserve(request, position, protected)
            if checkpoint_id is not None:
                saves.append(CheckpointSave(checkpoint_id, position))
        if start < request.checkpoint_junction <= end:
            request.checkpoint_junction = 0
        return tuple(saves)

    def use(self, ck: Checkpoint) -> None:
        """A request restores `ck` this step: it becomes protected and most recently used."""
        self.num_restored += 1
        self._promote(ck)

    def reserve(self, request: Request, num_tokens: int, protected: bool) -> int | None:
        """A new PENDING checkpoint for the state after the request's first `num_tokens` tokens,
        written by this step's forward; None when one exists already or none can be freed."""
        ck = self._reserve(request, num_tokens, protected, CheckpointState.PENDING)
        return None if ck is None else ck.checkpoint_id

    def reserve_queued(self, request: Request) -> None:
        """Keep the state a request's slot holds now, after `num_computed_tokens` tokens (it
        finishes or is preempted): a QUEUED checkpoint, copied at the start of the next step."""
        assert request.state_slot is not None, f"{request.request_id}: no state slot to keep"
        n = request.num_computed_tokens
        ck = self._reserve(request, n, True, CheckpointState.QUEUED)
        if ck is not None:
            page = request.block_table[n // self.block_size] if n % self.block_size else None
            self._queued.append((ck, StateSave(ck.checkpoint_id, request.state_slot, page)))

    def mark_ready(self, checkpoint_ids: list[int]) -> None:
        """The step that wrote these PENDING checkpoints ran."""
        for checkpoint_id in checkpoint_ids:
            ck = self._pending.pop(checkpoint_id, None)
            if ck is not None:
                ck.state = CheckpointState.READY

    def take_queued(self) -> tuple[StateSave, ...]:
        """The queued copies, for the step about to run (it copies them before anything else)."""
        saves = tuple(save for _, save in self._queued)
        for ck, _ in self._queued:
            ck.state = CheckpointState.READY
        self._queued.clear()
        return saves

    def reset(self) -> None:
        """Forget every checkpoint (the prefix cache was reset)."""
        for ck in list(self._probation) + list(self._protected):
            self._remove(ck, demote=False)

    # ---- the prefix cache's listener -------------------------------------------------------------
    def page_evicted(self, block_hash: bytes) -> None:
        for ck in list(self._users.get(block_hash, ())):
            self.num_invalidated += 1
            self._remove(ck, demote=True)

    def page_wanted(self, block_hash: bytes) -> bool:
        return block_hash in self._users

    # ---- internals -----------------------------------------------------------------------------
    def _reserve(self, request: Request, num_tokens: int, protected: bool, state: CheckpointState) -> Checkpoint | None:
        assert 0 < num_tokens <= request.num_tokens, f"{request.request_id}: no state at {num_tokens}"
        bs = self.block_size
        num_pages = num_tokens // bs
        self.blocks.extend_hashes(request, num_pages * bs)
        chain = tuple(request.block_hashes[:num_pages])
        tail = tuple(request.token_slice(num_pages * bs, num_tokens))
        existing = self._by_parent.get(chain[-1] if chain else ROOT_HASH, {}).get(tail)
        if existing is not None:
            if protected:
                self._promote(existing)
            return None
        checkpoint_id = self._take_id()
        if checkpoint_id is None:
            return None
        ck = Checkpoint(checkpoint_id, chain, tail, state, protected)
        self._by_parent.setdefault(ck.parent, {})[tail] = ck
        kept = [h for h in chain if h not in self._users]
        for h in chain:
            self._users.setdefault(h, set()).add(ck)
        if kept and self.page_sink is not None:
            self.page_sink.pages_kept(kept)
        (self._protected if protected else self._probation)[ck] = None
        if state is CheckpointState.PENDING:
            self._pending[checkpoint_id] = ck
        self.num_saved += 1
        return ck

    def _take_id(self) -> int | None:
        if self._free:
            return heapq.heappop(self._free)
        for segment in (self._probation, self._protected):
            victim = next((ck for ck in segment if ck.state is CheckpointState.READY), None)
            if victim is not None:
                self.num_evicted += 1
                self._remove(victim, demote=True)
                return heapq.heappop(self._free)
        return None  # every checkpoint is being written this step

    def _promote(self, ck: Checkpoint) -> None:
        if not ck.protected:
            del self._probation[ck]
            ck.protected = True
            self._protected[ck] = None
        self._protected.move_to_end(ck)

    def _remove(self, ck: Checkpoint, demote: bool) -> None:
        if demote and self.host is not None and ck.state is CheckpointState.READY:
            self.host.spill_snapshot(ck.checkpoint_id, ck.chain, ck.tail)
        group = self._by_parent[ck.parent]
        del group[ck.tail]
        if not group:
            del self._by_parent[ck.parent]
        del (self._protected if ck.protected else self._probation)[ck]
        if ck.state is CheckpointState.QUEUED:
            self._queued = [(c, s) for c, s in self._queued if c is not ck]
        self._pending.pop(ck.checkpoint_id, None)
        released = []
        for h in ck.chain:
            users = self._users[h]
            users.discard(ck)
            if not users:
                del self._users[h]
                released.append(h)
                if demote:
                    self.blocks.demote(h)
        if released and self.page_sink is not None:
            self.page_sink.pages_released(released)
        heapq.heappush(self._free, ck.checkpoint_id)

    def check_invariants(self) -> None:
        """Every id is free or held by exactly one entry; the indexes agree (tests call this)."""
        entries = list(self._probation) + list(self._protected)
        ids = sorted([ck.checkpoint_id for ck in entries] + self._free)
        assert ids == list(range(self.num_checkpoints)), f"checkpoint ids leaked or doubled: {ids}"
        assert sum(len(g) for g in self._by_parent.values()) == len(entries), "parent index out of step"
        for ck in entries:
            assert self._by_parent[ck.parent][ck.tail] is ck, f"checkpoint {ck.checkpoint_id} not indexed"
            assert all(ck in self._users[h] for h in ck.chain), f"checkpoint {ck.checkpoint_id}: pages not indexed"
        assert all(ck.state is CheckpointState.QUEUED for ck, _ in self._queued), "a queued copy of a non-queued entry"
