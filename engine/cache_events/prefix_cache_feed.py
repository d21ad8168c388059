"""`PrefixCacheFeed`: with data parallel, what each step changed in this core's prefix cache, sent
to the front with the step's outputs (`EngineCoreOutputs.prefix_cache`), so that the front places
a request on the core holding its prefix (engine/client/placement.py). It is the block manager's
`KVCacheEventSink` (scheduler/block_manager.py), so it sees the cache's own decisions: a page
hashed into the cache, a cached page reused for other tokens, a reset. It passes every call on to
the sink it replaced (the KV-events recorder, engine/cache_events/kv_events.py, when events are on).

Installed by the engine core only with --data-parallel-size above 1: with one core the block
manager has no sink (or only the KV-events one) and nothing here runs.
"""

from __future__ import annotations

from engine.core_types import PrefixCacheDelta
from scheduler.block_manager import KVCacheEventSink
from scheduler.request import Request


class PrefixCacheFeed:
    """Collects one step's changes on the engine's step thread: for each page hash touched, whether
    it is in the cache at the end (so a hash evicted and stored again within a step is sent once,
    as it ends up)."""

    def __init__(self, inner: KVCacheEventSink | None = None) -> None:
        self.inner = inner
        self._touched: dict[bytes, bool] = {}  # page hash -> in the cache now
        self._cleared = False

    def blocks_stored(self, request: Request, block_indices: list[int]) -> None:
        for i in block_indices:
            self._touched[request.block_hashes[i]] = True
        if self.inner is not None:
            self.inner.blocks_stored(request, block_indices)

    def block_removed(self, block_hash: bytes) -> None:
        self._touched[block_hash] = False
        if self.inner is not None:
            self.inner.block_removed(block_hash)

    def all_cleared(self) -> None:
        self._touched.clear()
        self._cleared = True
        if self.inner is not None:
            self.inner.all_cleared()

    def host_stored(self, block_hash: bytes) -> None:
        # Placement counts the device's pages only (a host hit still costs the copy back).
        if self.inner is not None:
            self.inner.host_stored(block_hash)

    def host_removed(self, block_hash: bytes) -> None:
        if self.inner is not None:
            self.inner.host_removed(block_hash)

    def take(self) -> PrefixCacheDelta | None:
        """The changes since the last take, or None when there were none."""
        if not self._touched and not self._cleared:
            return None
        touched = self._touched
        delta = PrefixCacheDelta(
            stored=tuple(h for h, cached in touched.items() if cached),
            removed=tuple(h for h, cached in touched.items() if not cached),
            cleared=self._cleared,
        )
        self._touched, self._cleared = {}, False
        return delta
