"""The host-memory tier (`--kv-offloading-size`) as bookkeeping: host slots for full KV pages, keyed
by the prefix cache's chained hash, and for hybrid models' state snapshots, keyed like the device
checkpoints (scheduler/checkpoint_manager.py); one LRU order per kind; and the copies each step
carries to the runner (`HostCopies`), which owns the host tensors (engine/attention/host_pool.py).

    device evicts a cached page  ->  spill it to a host slot (unless a host slot holds it already)
    device drops a checkpoint    ->  spill it to a host snapshot slot (while its pages are in a tier)
    prefix lookup: device pages [h0 h1] then host pages [h2 h3]  ->  fresh device pages, loaded from host
                   deepest snapshot among device checkpoints and host snapshots -> restored

A snapshot lives only while every page of its chain is in one of the tiers. Host slots a lookup
may load from are pinned until the step's copies are taken, so no spill of the same step reuses
them (spills run before loads). Imports no torch.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.block_manager import ROOT_HASH, KVCacheEventSink
from scheduler.output import HostCopies, HostTierStats, PageCopy, SnapshotLoad, SnapshotSpill
from scheduler.request import Request


@dataclass(eq=False)
class HostSnapshot:
    host_slot: int
    chain: tuple[bytes, ...]  # hashes of its full pages
    tail: tuple[int, ...]  # tokens after them (their KV is kept with the snapshot)

    @property
    def parent(self) -> bytes:
        return self.chain[-1] if self.chain else ROOT_HASH


@dataclass(frozen=True)
class HostHit:
    """What a lookup found past the device's pages: host slots of the next pages, in order, and the
    deepest host snapshot whose pages are all among the device's and these (None: none)."""

    host_slots: tuple[int, ...] = ()
    snapshot: HostSnapshot | None = None


class HostTier:
    def __init__(
        self, num_pages: int, num_snapshots: int, block_size: int, device_cached: Callable[[bytes], bool]
    ) -> None:
        """`device_cached(hash)`: whether the device's prefix cache holds that page (block_manager)."""
        assert num_pages > 0, "a host tier needs a page"
        self.num_pages = num_pages
        self.num_snapshots = num_snapshots
        self.block_size = block_size
        self.device_cached = device_cached
        self.pages: OrderedDict[bytes, int] = OrderedDict()  # hash -> host slot, least recently used first
        self._free_pages = list(range(num_pages))  # min-heaps: predictable slots in tests
        self._free_snapshots = list(range(num_snapshots))
        self.snapshots: OrderedDict[HostSnapshot, None] = OrderedDict()  # least recently used first
        self._by_parent: dict[bytes, dict[tuple[int, ...], HostSnapshot]] = {}
        self._users: dict[bytes, set[HostSnapshot]] = {}  # page hash -> the snapshots that need it
        self._pinned_pages: set[int] = set()
        self._pinned_snapshots: set[int] = set()
        self._page_spills: list[PageCopy] = []
        self._snapshot_spills: list[SnapshotSpill] = []
        self._page_loads: list[PageCopy] = []
        self._snapshot_loads: list[SnapshotLoad] = []
        self.event_sink: KVCacheEventSink | None = None  # KV events, medium "CPU" (set by the engine core)
        # Cumulative counters (carried over an engine restart: Scheduler.restore).
        self.num_spilled_pages = 0
        self.num_loaded_pages = 0
        self.num_spilled_snapshots = 0
        self.num_loaded_snapshots = 0
        self.num_hit_tokens = 0  # prompt tokens served from the host tier
        self.num_queried_tokens = 0  # prompt tokens looked up past the device's hit
        self.load_seconds = 0.0  # the runner's copy time, added by the engine core
        self.spill_seconds = 0.0

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_used_pages(self) -> int:
        return len(self.pages)

    @property
    def num_used_snapshots(self) -> int:
        return len(self.snapshots)

    def holds(self, block_hash: bytes) -> bool:
        return block_hash in self.pages

    def stats(self, page_bytes: int, snapshot_bytes: int) -> HostTierStats:
        return HostTierStats(
            self.num_pages,
            len(self.pages),
            self.num_snapshots,
            len(self.snapshots),
            page_bytes,
            snapshot_bytes,
            self.num_hit_tokens,
            self.num_queried_tokens,
            self.num_loaded_pages,
            self.num_spilled_pages,
            self.num_loaded_snapshots,
            self.num_spilled_snapshots,
            self.load_seconds,
            self.spill_seconds,
        )

    def restore(self, last: HostTierStats) -> None:
        """Carry on a lost engine's cumulative counters, so they never go back."""
        self.num_hit_tokens, self.num_queried_tokens = last.hit_tokens, last.queried_tokens
        self.num_loaded_pages, self.num_spilled_pages = last.loaded_pages, last.spilled_pages
        self.num_loaded_snapshots, self.num_spilled_snapshots = last.loaded_snapshots, last.spilled_snapshots
        self.load_seconds, self.spill_seconds = last.load_seconds, last.spill_seconds

    def snapshot_tokens(self, snapshot: HostSnapshot) -> int:
        return len(snapshot.chain) * self.block_size + len(snapshot.tail)

    def lookup(self, request: Request, num_device_pages: int, hybrid: bool) -> HostHit:
        """The pages after the request's `num_device_pages` leading device-cached ones that the host
        holds (up to `num_tokens - 1` tokens, so the last token yields logits), and for a hybrid the
        deepest host snapshot within the pages of both tiers. Pins what it returns for this step.
        Counts nothing (a waiting request is looked up every step)."""
        bs = self.block_size
        max_pages = (request.num_tokens - 1) // bs
        slots: list[int] = []
        for h in request.block_hashes[num_device_pages:max_pages]:
            slot = self.pages.get(h)
            if slot is None:
                break
            slots.append(slot)
        self._pinned_pages.update(slots)
        snapshot = self._find_snapshot(request, num_device_pages + len(slots)) if hybrid else None
        if snapshot is not None:
            self._pinned_snapshots.add(snapshot.host_slot)
        return HostHit(tuple(slots), snapshot)

    # ---- the scheduler's orders ------------------------------------------------------------------
    def load_pages(self, request: Request, first: int, host_slots: tuple[int, ...]) -> None:
        """Copy host slots into the request's device pages `first`, `first + 1`, ... before the forward."""
        for i, slot in enumerate(host_slots):
            self._page_loads.append(PageCopy(request.block_table[first + i], slot))
            self.pages.move_to_end(request.block_hashes[first + i])
        self.num_loaded_pages += len(host_slots)

    def load_snapshot(self, request: Request, snapshot: HostSnapshot) -> None:
        """Copy a host snapshot into the request's state slot (and partial page) before the forward."""
        assert request.state_slot is not None, f"{request.request_id}: a snapshot load without a state slot"
        n = self.snapshot_tokens(snapshot)
        page = request.block_table[n // self.block_size] if n % self.block_size else None
        self._snapshot_loads.append(SnapshotLoad(snapshot.host_slot, request.state_slot, page))
        self.snapshots.move_to_end(snapshot)
        self.num_loaded_snapshots += 1

    def take_copies(self) -> HostCopies:
        """This step's copies (spills first), and the pins end: the step that runs them is scheduled."""
        copies = HostCopies(
            tuple(self._page_spills), tuple(self._snapshot_spills), tuple(self._page_loads), tuple(self._snapshot_loads)
        )
        self._page_spills, self._snapshot_spills, self._page_loads, self._snapshot_loads = [], [], [], []
        self.unpin()
        return copies

    def unpin(self) -> None:
        """A schedule that runs no step: its lookups loaded nothing (its spills wait for the next step)."""
        assert not self._page_loads and not self._snapshot_loads, "loads ordered for a step that does not run"
        self._pinned_pages.clear()
        self._pinned_snapshots.clear()

    # ---- what the device tier drops ----------------------------------------------------------------
    def spill_page(self, block_hash: bytes, device_page: int) -> bool:
        """The device evicts this cached page (before the step reuses it): keep it. False when no
        host slot can take it (every one pinned); the page then leaves both tiers."""
        slot = self.pages.get(block_hash)
        if slot is not None:  # loaded from here earlier: the host copy is the same
            self.pages.move_to_end(block_hash)
            return True
        slot = self._take_page_slot()
        if slot is None:
            return False
        self.pages[block_hash] = slot
        self._page_spills.append(PageCopy(device_page, slot))
        self.num_spilled_pages += 1
        if self.event_sink is not None:
            self.event_sink.host_stored(block_hash)
        return True

    def page_gone(self, block_hash: bytes) -> None:
        """A page left the device and is not here: the snapshots that need it go."""
        for snapshot in list(self._users.get(block_hash, ())):
            self._remove_snapshot(snapshot)

    def spill_snapshot(self, checkpoint_id: int, chain: tuple[bytes, ...], tail: tuple[int, ...]) -> None:
        """The device drops a written checkpoint: keep it while its pages are all in a tier."""
        if not self.num_snapshots or not all(h in self.pages or self.device_cached(h) for h in chain):
            return
        parent = chain[-1] if chain else ROOT_HASH
        existing = self._by_parent.get(parent, {}).get(tail)
        if existing is not None:
            self.snapshots.move_to_end(existing)
            return
        slot = self._take_snapshot_slot()
        if slot is None:
            return
        snapshot = HostSnapshot(slot, chain, tail)
        self._by_parent.setdefault(parent, {})[tail] = snapshot
        for h in chain:
            self._users.setdefault(h, set()).add(snapshot)
        self.snapshots[snapshot] = None
        self._snapshot_spills.append(SnapshotSpill(checkpoint_id, slot))
        self.num_spilled_snapshots += 1

    def reset(self) -> None:
        """Forget everything (the prefix cache was reset: a failed step may have left spills unrun)."""
        self._page_spills, self._snapshot_spills, self._page_loads, self._snapshot_loads = [], [], [], []
        self.unpin()
        for h in list(self.pages):
            self._drop_page(h)
        for snapshot in list(self.snapshots):
            self._remove_snapshot(snapshot)

    # ---- internals -----------------------------------------------------------------------------------
    def _find_snapshot(self, request: Request, num_pages: int) -> HostSnapshot | None:
        bs = self.block_size
        limit = request.num_tokens - 1
        hashes = request.block_hashes
        for i in range(min(num_pages, limit // bs), -1, -1):
            group = self._by_parent.get(hashes[i - 1] if i else ROOT_HASH)
            best: HostSnapshot | None = None
            for tail, snapshot in (group or {}).items():
                end = i * bs + len(tail)
                if end == 0 or end > limit or (best is not None and len(tail) <= len(best.tail)):
                    continue
                if tail and tuple(request.token_slice(i * bs, end)) != tail:
                    continue
                best = snapshot
            if best is not None:
                return best
        return None

    def _take_page_slot(self) -> int | None:
        if self._free_pages:
            return heapq.heappop(self._free_pages)
        victim = next((h for h, slot in self.pages.items() if slot not in self._pinned_pages), None)
        if victim is None:
            return None
        self._drop_page(victim)
        return heapq.heappop(self._free_pages)

    def _drop_page(self, block_hash: bytes) -> None:
        heapq.heappush(self._free_pages, self.pages.pop(block_hash))
        if self.event_sink is not None:
            self.event_sink.host_removed(block_hash)
        if not self.device_cached(block_hash):
            self.page_gone(block_hash)

    def _take_snapshot_slot(self) -> int | None:
        if self._free_snapshots:
            return heapq.heappop(self._free_snapshots)
        victim = next((s for s in self.snapshots if s.host_slot not in self._pinned_snapshots), None)
        if victim is None:
            return None
        self._remove_snapshot(victim)
        return heapq.heappop(self._free_snapshots)

    def _remove_snapshot(self, snapshot: HostSnapshot) -> None:
        group = self._by_parent[snapshot.parent]
        del group[snapshot.tail]
        if not group:
            del self._by_parent[snapshot.parent]
        del self.snapshots[snapshot]
        for h in snapshot.chain:
            users = self._users[h]
            users.discard(snapshot)
            if not users:
                del self._users[h]
        heapq.heappush(self._free_snapshots, snapshot.host_slot)

    def check_invariants(self) -> None:
        """Every slot is free or held by exactly one entry; the indexes agree (tests call this)."""
        pages = sorted(list(self.pages.values()) + self._free_pages)
        assert pages == list(range(self.num_pages)), f"host page slots leaked or doubled: {pages}"
        snaps = sorted([s.host_slot for s in self.snapshots] + self._free_snapshots)
        assert snaps == list(range(self.num_snapshots)), f"host snapshot slots leaked or doubled: {snaps}"
        for snapshot in self.snapshots:
            assert self._by_parent[snapshot.parent][snapshot.tail] is snapshot, "snapshot not indexed"
            assert all(h in self.pages or self.device_cached(h) for h in snapshot.chain), (
                f"host snapshot {snapshot.host_slot} outlived a page of its chain"
            )
