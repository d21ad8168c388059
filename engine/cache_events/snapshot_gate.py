"""KV events of a hybrid model (Gated DeltaNet + attention): a prefix hit reaches only as far as a
DeltaNet state snapshot whose pages are cached (scheduler/checkpoint_manager.py), so a router must
be told of those pages alone. `SnapshotGate` sits between the block manager and the recorder:

    block manager --blocks_stored / block_removed / all_cleared--> SnapshotGate --> KVEventRecorder
    checkpoint manager --pages_kept / pages_released------------->     (BlockStored while a page is
                                                                        cached AND a snapshot needs it)

A page is announced (BlockStored) once it is both in the prefix cache and in the chain of some
snapshot, in whichever order the two happen; it is withdrawn (BlockRemoved) when the cache evicts
it or when the last snapshot that needed it goes. Chains start at the first page, so what is
announced is always a run from a prompt's start: a router's longest-prefix match stays whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.cache_events.kv_events import KVEventRecorder
from scheduler.request import Request


@dataclass(frozen=True)
class _Page:
    """A cached page, as it would be announced: its wire hash, its parent's, and its tokens."""

    wire: int
    parent: int | None
    token_ids: tuple[int, ...]


class SnapshotGate:
    """The block manager's `KVCacheEventSink` and the checkpoint manager's `SnapshotPageSink` for a
    hybrid with KV events on. Runs on the engine's step thread."""

    def __init__(self, recorder: KVEventRecorder) -> None:
        self.recorder = recorder
        self._cached: dict[bytes, _Page] = {}  # every page in the prefix cache, by internal hash
        self._wanted: set[bytes] = set()  # pages some snapshot needs (cached or not yet)
        self._announced: set[bytes] = set()

    # ---- the block manager's sink ---------------------------------------------------------------
    def blocks_stored(self, request: Request, block_indices: list[int]) -> None:
        hashes = self.recorder.hashes
        bs = hashes.block_size
        runs: list[list[int]] = []
        for i in block_indices:  # consecutive runs: each hash chains on the one before it
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            parent = hashes.parent_of(request, run[0])
            for i, wire in zip(run, hashes.store(request, run)):
                self._cached[request.block_hashes[i]] = _Page(
                    wire, parent, tuple(request.token_slice(i * bs, (i + 1) * bs))
                )
                parent = wire
        self._announce([request.block_hashes[i] for i in block_indices])

    def block_removed(self, block_hash: bytes) -> None:
        self._cached.pop(block_hash, None)
        wire = self.recorder.hashes.remove(block_hash)
        if block_hash in self._announced:
            self._announced.discard(block_hash)
            self.recorder.removed([wire])

    def all_cleared(self) -> None:
        self._cached.clear()
        self._wanted.clear()
        self._announced.clear()
        self.recorder.all_cleared()

    def host_stored(self, block_hash: bytes) -> None:
        self.recorder.host_stored(block_hash)

    def host_removed(self, block_hash: bytes) -> None:
        self.recorder.host_removed(block_hash)

    # ---- the checkpoint manager's sink -------------------------------------------------------------
    def pages_kept(self, block_hashes: list[bytes]) -> None:
        self._wanted.update(block_hashes)
        self._announce(block_hashes)

    def pages_released(self, block_hashes: list[bytes]) -> None:
        self._wanted.difference_update(block_hashes)
        gone = [h for h in block_hashes if h in self._announced]
        if gone:
            self._announced.difference_update(gone)
            self.recorder.removed([self._cached[h].wire for h in gone])

    # ---- internals ---------------------------------------------------------------------------------
    def _announce(self, block_hashes: list[bytes]) -> None:
        """BlockStored for those of these pages (in chain order) now cached and wanted, not yet told."""
        run: list[_Page] = []
        for h in block_hashes:
            page = self._cached.get(h)
            if page is None or h not in self._wanted or h in self._announced:
                continue
            self._announced.add(h)
            if run and page.parent != run[-1].wire:
                self._emit(run)
                run = []
            run.append(page)
        if run:
            self._emit(run)

    def _emit(self, run: list[_Page]) -> None:
        self.recorder.stored([p.wire for p in run], run[0].parent, [t for p in run for t in p.token_ids])
