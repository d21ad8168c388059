"""CUDA-graph decode: the batch-size buckets and `CudaGraphRunner`, which captures one graph of the
model's forward per bucket at start-up and replays it for pure-decode steps, each batch padded to
its bucket with dummy rows over a scratch KV page and, for hybrids, the state pool's scratch slot
(engine/cuda_graph_padding.py). With speculative decoding it also captures one graph per bucket for
verify steps, where every request has the same 1 + k query rows; every other step runs eagerly.

Only the forward (embeddings to final norm) is captured; logits and sampling stay eager.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from tqdm import tqdm

from engine.attention.backend import AttentionBackend
from engine.attention.hybrid_backend import HybridBackend
from engine.batch import ForwardBatch, build_forward_batch
from engine.cuda_graph_padding import (
    PADDING_REQUEST_ID,
    is_pure_decode,
    pad_decode_batch,
    uniform_query_len,
    verify_graph_query_len,
)
from engine.models.decoder import DecoderForCausalLM
from scheduler.output import SchedulerOutput

logger = logging.getLogger("fp4serve.cuda_graph")

# Re-exported: callers pad and test batches through this module.
__all__ = [
    "PADDING_REQUEST_ID",
    "is_pure_decode",
    "pad_decode_batch",
    "uniform_query_len",
    "verify_graph_query_len",
    "CudaGraphRunner",
    "DecodeBuckets",
    "GraphAttentionBackend",
    "VerifyGraphBackend",
    "graphs_disabled_reason",
    "can_capture",
    "can_capture_verify",
    "CudaGraphCapturer",
    "GraphCapturer",
    "CapturedGraph",
]

SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32)  # fine steps where a decode batch is latency-bound
BUCKET_STEP = 16  # beyond 32: padding at most 15 rows costs little next to the weights read


@dataclass(frozen=True)
class DecodeBuckets:
    """The decode batch sizes that get a graph, ascending. A batch of B requests replays the
    smallest bucket >= B; above the largest it runs eagerly."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        assert self.sizes, "no bucket sizes"
        assert list(self.sizes) == sorted(set(self.sizes)) and self.sizes[0] >= 1, f"bad buckets {self.sizes}"

    @staticmethod
    def up_to(max_num_seqs: int) -> DecodeBuckets:
        """1, 2, 4, 8, 16, 24, 32, then every 16, capped at and always ending with max_num_seqs."""
        assert max_num_seqs >= 1, f"max_num_seqs {max_num_seqs}"
        sizes = [s for s in SMALL_BUCKETS if s < max_num_seqs]
        sizes += range(SMALL_BUCKETS[-1] + BUCKET_STEP, max_num_seqs, BUCKET_STEP)
        return DecodeBuckets((*sizes, max_num_seqs))

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def bucket_for(self, batch_size: int) -> int | None:
        i = bisect.bisect_left(self.sizes, batch_size)
        return self.sizes[i] if i < len(self.sizes) and batch_size >= 1 else None


@runtime_checkable
class GraphAttentionBackend(Protocol):
    """An attention backend whose decode can be captured: fixed buffers per batch size, planned
    outside the graph (FlashInferAttentionBackend)."""

    name: str

    def plan(self, batch: ForwardBatch) -> None: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor: ...

    def prepare_graphs(self, batch_sizes: Sequence[int], max_num_pages: int) -> None: ...

    def plan_graph(self, batch: ForwardBatch) -> None: ...


@runtime_checkable
class VerifyGraphBackend(Protocol):
    """A graph backend that also captures verify steps (FlashInferAttentionBackend's prefill wrappers)."""

    def prepare_verify_graphs(self, batch_sizes: Sequence[int], query_len: int, max_num_pages: int) -> None: ...


def can_capture(backend: AttentionBackend) -> bool:
    if isinstance(backend, HybridBackend):
        return backend.graph_capable()
    return isinstance(backend, GraphAttentionBackend)


def can_capture_verify(backend: AttentionBackend) -> bool:
    if isinstance(backend, HybridBackend):
        return backend.verify_graph_capable()
    return isinstance(backend, GraphAttentionBackend) and isinstance(backend, VerifyGraphBackend)


def graphs_disabled_reason(enforce_eager: bool, device: torch.device, backend: AttentionBackend) -> str | None:
    """Why decode runs without CUDA graphs, or None when it can use them."""
    if enforce_eager:
        return "--enforce-eager"
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    if not can_capture(backend):
        return f"the {backend.name} attention backend plans on the host every step and cannot be captured"
    return None


class CapturedGraph(Protocol):
    output: torch.Tensor  # written by every replay(), at a fixed address

    def replay(self) -> None: ...


class GraphCapturer(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph: ...


@dataclass
class _CudaGraph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphCapturer:
    """torch.cuda.CUDAGraph capture. All graphs share the first one's memory pool; captured
    largest first, the smaller ones fit in blocks it already holds."""

    def __init__(self) -> None:
        self._pool: tuple[int, int] | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = fn()
        if self._pool is None:
            self._pool = graph.pool()
        return _CudaGraph(graph, output)


class CudaGraphRunner:
    """Runs the model's forward for one `ForwardBatch`: a graph replay for pure-decode batches
    up to the largest bucket (and, with `verify_query_len`, for verify steps whose every request
    has that many rows), the eager forward for everything else (prefill or mixed batches, bigger
    batches, ragged verify steps, and every batch before `capture()`)."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        buckets: DecodeBuckets,
        scratch_page: int,
        max_pages_per_seq: int,
        capturer: GraphCapturer | None = None,
        verify_query_len: int | None = None,
    ) -> None:
        """`scratch_page` is a KV page no request ever owns (the runner allocates one page more
        than it gives the scheduler); dummy rows write there, and a hybrid's dummy rows use its
        state pool's scratch slot. Any backend runs eagerly; capture() needs a graph backend.
        `verify_query_len` (1 + k with k drafts per request): also capture verify steps of that
        many rows per request, when the backend can."""
        num_pages, _, block_size = kv_caches[0].shape[:3]
        assert 0 <= scratch_page < num_pages, f"scratch page {scratch_page} outside the cache's {num_pages} pages"
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.buckets = buckets
        self.scratch_page = scratch_page
        self.block_size = block_size
        self.device = kv_caches[0].device
        self.max_num_pages = buckets.largest * max_pages_per_seq
        self.scratch_slot = backend.scratch_slot if isinstance(backend, HybridBackend) else None
        self._capturer = capturer if capturer is not None else CudaGraphCapturer()
        self._graphs: dict[tuple[int, int], CapturedGraph] = {}  # (requests, rows per request) -> graph
        self.verify_query_len: int | None = None
        self.enable_verify_graphs(verify_query_len)

    def enable_verify_graphs(self, query_len: int | None) -> None:
        """Before capture(): also capture verify steps of `query_len` rows per request (None: none),
        when the backend can."""
        assert not self._graphs, "verify graphs are chosen before capture()"
        assert query_len is None or 2 <= query_len <= self.block_size, f"verify steps of {query_len} rows per request"
        self.verify_query_len = query_len if query_len and can_capture_verify(self.backend) else None
        # The graphs' inputs: fixed addresses, rows [:size * rows per request] used by a graph.
        rows = self.buckets.largest * (self.verify_query_len or 1)
        self._input_ids = torch.zeros(rows, dtype=torch.int64, device=self.device)  # [largest * L]
        self._positions = torch.zeros(rows, dtype=torch.int64, device=self.device)  # [largest * L]

    @property
    def captured_sizes(self) -> list[int]:
        """The batch sizes with a decode graph."""
        return sorted(size for size, query_len in self._graphs if query_len == 1)

    @property
    def captured_verify_sizes(self) -> list[int]:
        """The batch sizes with a verify-step graph."""
        return sorted(size for size, query_len in self._graphs if query_len > 1)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first, each after one eager warm-up run (Triton
        compiles and cuBLAS picks its kernels outside the capture)."""
        start = time.perf_counter()
        assert can_capture(self.backend), f"the {self.backend.name} backend cannot be captured"
        backend: GraphAttentionBackend = self.backend  # type: ignore[assignment]
        backend.prepare_graphs(self.buckets.sizes, self.max_num_pages)
        shapes = [(size, 1) for size in sorted(self.buckets.sizes, reverse=True)]
        if self.verify_query_len is not None:
            verify: VerifyGraphBackend = self.backend  # type: ignore[assignment]
            verify.prepare_verify_graphs(self.buckets.sizes, self.verify_query_len, self.max_num_pages)
            shapes += [(size, self.verify_query_len) for size in sorted(self.buckets.sizes, reverse=True)]
        empty = build_forward_batch(SchedulerOutput((), ()), self.block_size, self.device)
        for size, query_len in tqdm(shapes, desc="capturing CUDA graphs", unit="graph", disable=None):
            self._load_inputs(self._pad(empty, size, query_len))
            self._run_static(size, query_len)
            try:
                self._graphs[size, query_len] = self._capturer.capture(
                    functools.partial(self._run_static, size, query_len)
                )
            except RuntimeError as e:
                raise RuntimeError(
                    f"CUDA graph capture failed at batch size {size} x {query_len} rows ({e}); "
                    "start with --enforce-eager to run without CUDA graphs"
                ) from e
        logger.info(
            "captured %d CUDA graphs (batch sizes %s; decode%s) in %.1f s",
            len(shapes),
            ",".join(map(str, self.buckets.sizes)),
            f" and verify steps of {self.verify_query_len} rows" if self.verify_query_len else "",
            time.perf_counter() - start,
        )

    def graph_size_for(self, batch: ForwardBatch) -> int | None:
        """The captured size this batch replays, or None when it runs eagerly."""
        query_len = uniform_query_len(batch)
        if not self._graphs or query_len is None or batch.interior_saves:
            return None
        size = self.buckets.bucket_for(batch.num_requests)
        return size if (size, query_len) in self._graphs else None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] of the batch's rows.

        NOTE: after a replay this is a view of the graph's output buffer: the next forward
        overwrites it, so use it (logits) before running another step."""
        size = self.graph_size_for(batch)
        if size is None:
            self.backend.plan(batch)
            return self.model(batch.input_ids, batch.positions, self.kv_caches, self.backend)
        assert batch.kv_indices.numel() <= self.max_num_pages, "a sequence is longer than max_pages_per_seq"
        query_len = batch.query_lens[0]
        self._load_inputs(self._pad(batch, size, query_len))
        graph = self._graphs[size, query_len]
        graph.replay()
        return graph.output[: batch.num_tokens]

    def _pad(self, batch: ForwardBatch, size: int, query_len: int) -> ForwardBatch:
        return pad_decode_batch(batch, size, self.scratch_page, query_len, self.scratch_slot)

    def _load_inputs(self, padded: ForwardBatch) -> None:
        """Outside the graph: the padded step's tokens into the input buffers, its metadata (page
        tables, KV write rows, state slots) into the backend's fixed buffers."""
        num_tokens = padded.num_tokens
        self._input_ids[:num_tokens].copy_(padded.input_ids)
        self._positions[:num_tokens].copy_(padded.positions)
        backend: GraphAttentionBackend = self.backend  # type: ignore[assignment]
        backend.plan_graph(padded)

    def _run_static(self, size: int, query_len: int = 1) -> torch.Tensor:
        rows = size * query_len
        return self.model(self._input_ids[:rows], self._positions[:rows], self.kv_caches, self.backend)
