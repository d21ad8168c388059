"""The host-memory tier's tensors (`--kv-offloading-size`): host slots for full KV pages (every
attention layer, the MTP head's too) and for hybrid models' state snapshots (a checkpoint's
DeltaNet state and partial page), allocated once at start-up, and the copies the scheduler orders
(scheduler/host_tier.py, `HostCopies`). On CUDA the host tensors are pinned and the copies run on a
side stream, which waits for the work already queued (the pages are final) and which the forward
waits for through an event; on CPU they are plain index copies."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import torch

from engine.attention.checkpoint_pool import CheckpointPool
from engine.attention.state_pool import StatePool
from engine.errors import ConfigError
from scheduler.output import HostCopies

logger = logging.getLogger("fp4serve.runner")

_GIB = 1 << 30
_MIB = 1 << 20


def _index(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def split_budget(
    budget: int, page_bytes: int, snapshot_bytes: int, device_kv_bytes: int, device_checkpoint_bytes: int
) -> tuple[int, int]:
    """(pages, snapshots) the host budget holds: snapshots take the share of it that checkpoints take
    of the device's cache memory (a snapshot is of use only with its pages, so the two grow together)."""
    share = device_checkpoint_bytes / (device_checkpoint_bytes + device_kv_bytes) if snapshot_bytes else 0.0
    num_snapshots = int(budget * share) // snapshot_bytes if snapshot_bytes else 0
    num_pages = (budget - num_snapshots * snapshot_bytes) // page_bytes
    return int(num_pages), int(num_snapshots)


class HostPool:
    def __init__(
        self,
        budget_bytes: int,
        kv_caches: Sequence[torch.Tensor],
        num_device_pages: int,
        checkpoints: CheckpointPool | None,
        device: torch.device,
    ) -> None:
        """`kv_caches`: every attention layer's [num_pages, 2, block_size, Hkv, D] cache (the MTP head's
        too); `num_device_pages`: the scheduler's pages (each cache may hold scratch pages beyond)."""
        self.device = device
        self.kv_caches = list(kv_caches)
        self.page_bytes = sum(cache[0].nbytes for cache in self.kv_caches)
        self.snapshot_bytes = checkpoints.bytes_per_checkpoint if checkpoints is not None else 0
        device_kv = self.page_bytes * num_device_pages
        self.num_pages, self.num_snapshots = split_budget(
            budget_bytes,
            self.page_bytes,
            self.snapshot_bytes,
            device_kv,
            checkpoints.nbytes if checkpoints is not None else 0,
        )
        if self.num_pages < 1:
            raise ConfigError(
                f"--kv-offloading-size: {budget_bytes / _GIB:g} GiB holds no KV page of {self.page_bytes} bytes"
            )
        pin = device.type == "cuda"
        # one [num_host_pages, 2, block_size, Hkv, D] tensor per attention layer, the cache's dtype, host
        # NOTE: empty, not zeros: a slot is written before it is read, and untouched pages stay uncommitted.
        self.pages = [
            torch.empty((self.num_pages, *cache.shape[1:]), dtype=cache.dtype, pin_memory=pin)
            for cache in self.kv_caches
        ]
        self.conv = self.recurrent = self.kv = None
        if checkpoints is not None and self.num_snapshots:
            n = self.num_snapshots
            # Slot-major, so one snapshot is one contiguous block: [n, num_deltanet_layers, conv_dim,
            # kernel - 1] and [n, num_deltanet_layers, Hv, Dk, Dv] float32, [n, num_kv_layers, 2,
            # block_size, Hkv, D] (the partial page) in the cache's dtype; host
            self.conv = torch.empty((n, *checkpoints.conv[:, 0].shape), dtype=checkpoints.conv.dtype, pin_memory=pin)
            self.recurrent = torch.empty(
                (n, *checkpoints.recurrent[:, 0].shape), dtype=checkpoints.recurrent.dtype, pin_memory=pin
            )
            self.kv = torch.empty((n, *checkpoints.kv[:, 0].shape), dtype=checkpoints.kv.dtype, pin_memory=pin)
        self.checkpoints = checkpoints
        self.stream = torch.cuda.Stream(device) if pin else None
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.load_seconds = 0.0  # cumulative; taken by the engine core after each step
        self.spill_seconds = 0.0
        snapshots = (
            f" and {self.num_snapshots} state snapshots x {self.snapshot_bytes / _MIB:.2f} MiB"
            if self.checkpoints is not None
            else ""
        )
        logger.info(
            "host KV tier (--kv-offloading-size): %.2f MiB: %d pages x %.3f MiB (%d tokens)%s, %s",
            self.nbytes / _MIB,
            self.num_pages,
            self.page_bytes / _MIB,
            self.num_pages * self.kv_caches[0].shape[2],
            snapshots,
            "pinned, copied on a side stream" if pin else "plain copies",
        )

    @property
    def nbytes(self) -> int:
        extra = sum(t.nbytes for t in (self.conv, self.recurrent, self.kv) if t is not None)
        return sum(t.nbytes for t in self.pages) + extra

    def spill(self, copies: HostCopies) -> None:
        """Device pages and checkpoints -> host slots: before anything else in the step writes them."""
        if not copies.page_spills and not copies.snapshot_spills:
            return
        with self._timed("spill"):
            for page in copies.page_spills:
                for cache, host in zip(self.kv_caches, self.pages):
                    host[page.host_slot].copy_(cache[page.device_page], non_blocking=True)
            ck = self.checkpoints
            if copies.snapshot_spills:
                assert ck is not None and self.conv is not None and self.recurrent is not None and self.kv is not None
                for s in copies.snapshot_spills:
                    self.conv[s.host_slot].copy_(ck.conv[:, s.checkpoint_id], non_blocking=True)
                    self.recurrent[s.host_slot].copy_(ck.recurrent[:, s.checkpoint_id], non_blocking=True)
                    self.kv[s.host_slot].copy_(ck.kv[:, s.checkpoint_id], non_blocking=True)

    def load(self, copies: HostCopies, slots: StatePool | None) -> None:
        """Host slots -> the pages and state slots of the requests that hit them, before the forward."""
        if not copies.page_loads and not copies.snapshot_loads:
            return
        with self._timed("load"):
            if copies.page_loads and self.device.type == "cpu":
                dst, src = (
                    _index([c.device_page for c in copies.page_loads]),
                    _index([c.host_slot for c in copies.page_loads]),
                )
                for cache, host in zip(self.kv_caches, self.pages):
                    cache.index_copy_(0, dst, host.index_select(0, src))
            else:
                for page in copies.page_loads:
                    for cache, host in zip(self.kv_caches, self.pages):
                        cache[page.device_page].copy_(host[page.host_slot], non_blocking=True)
            for s in copies.snapshot_loads:
                assert (
                    slots is not None and self.conv is not None and self.recurrent is not None and self.kv is not None
                )
                slots.conv[:, s.state_slot].copy_(self.conv[s.host_slot], non_blocking=True)
                slots.recurrent[:, s.state_slot].copy_(self.recurrent[s.host_slot], non_blocking=True)
                if s.kv_page is not None:
                    for layer, cache in enumerate(self.kv_caches):
                        cache[s.kv_page].copy_(self.kv[s.host_slot, layer], non_blocking=True)

    def take_seconds(self) -> tuple[float, float]:
        """(load, spill) seconds since the last take: wall time on CPU, CUDA event time on a GPU (of
        the copies that have completed)."""
        still = []
        for kind, start, end in self._pending:
            if not end.query():
                still.append((kind, start, end))
                continue
            seconds = start.elapsed_time(end) / 1000
            if kind == "load":
                self.load_seconds += seconds
            else:
                self.spill_seconds += seconds
        self._pending = still
        load, spill = self.load_seconds, self.spill_seconds
        self.load_seconds = self.spill_seconds = 0.0
        return load, spill

    def _timed(self, kind: str) -> _Timed:
        return _Timed(self, kind)


class _Timed:
    """Runs a batch of copies: on CUDA on the side stream (after the work queued so far, and before
    any work queued later: the current stream waits for its event); on CPU timed by the wall clock."""

    def __init__(self, pool: HostPool, kind: str) -> None:
        self.pool, self.kind = pool, kind
        self._t0 = 0.0
        self._ctx: torch.cuda.StreamContext | None = None
        self._start: torch.cuda.Event | None = None

    def __enter__(self) -> None:
        stream = self.pool.stream
        if stream is None:
            self._t0 = time.perf_counter()
            return
        stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        self._ctx = torch.cuda.stream(stream)
        self._ctx.__enter__()
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record(stream)

    def __exit__(self, *exc: object) -> None:
        stream = self.pool.stream
        if stream is None:
            elapsed = time.perf_counter() - self._t0
            if self.kind == "load":
                self.pool.load_seconds += elapsed
            else:
                self.pool.spill_seconds += elapsed
            return
        assert self._ctx is not None and self._start is not None
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        self._ctx.__exit__(*exc)
        torch.cuda.current_stream(self.pool.device).wait_event(end)  # the forward waits for the copies
        self.pool._pending.append((self.kind, self._start, end))


def make_host_pool(
    size_gib: float,
    prefix_caching: bool,
    kv_caches: Sequence[torch.Tensor],
    num_device_pages: int,
    checkpoints: CheckpointPool | None,
    slots: StatePool | None,
    device: torch.device,
) -> HostPool | None:
    """The host tier of `--kv-offloading-size GiB` (None: 0, or no prefix cache to extend)."""
    if not size_gib:
        return None
    if not prefix_caching or (slots is not None and checkpoints is None):
        logger.info("host KV tier off: --kv-offloading-size extends the prefix cache, which is off")
        return None
    return HostPool(int(math.floor(size_gib * _GIB)), kv_caches, num_device_pages, checkpoints, device)


def host_tier_fields(pool: HostPool | None) -> dict[str, int]:
    """The scheduler's view of the host tier (SchedulerConfig fields): slots and their bytes."""
    if pool is None:
        return {}
    return {
        "num_host_pages": pool.num_pages,
        "num_host_snapshots": pool.num_snapshots,
        "host_page_bytes": pool.page_bytes,
        "host_snapshot_bytes": pool.snapshot_bytes,
    }
