"""CUDA-graph decode: the batch-size buckets, padding a decode `ForwardBatch` to its bucket with dummy
rows over a reserved scratch page, and `CudaGraphRunner`, which captures one graph of the model's
forward per bucket at start-up and replays it for pure-decode steps; every other step runs eagerly.

Only the forward (embeddings to final norm) is captured; logits and sampling stay eager.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from tqdm import tqdm

from engine.attention.backend import AttentionBackend
from engine.batch import ForwardBatch, build_forward_batch
from engine.models.decoder import DecoderForCausalLM
from scheduler.output import SchedulerOutput

logger = logging.getLogger("fp4serve.cuda_graph")

SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32)  # fine steps where a decode batch is latency-bound
BUCKET_STEP = 16  # beyond 32: padding at most 15 rows costs little next to the weights read
PADDING_REQUEST_ID = ""  # request id of a dummy row; dummy rows are never sampled


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


def is_pure_decode(batch: ForwardBatch) -> bool:
    return batch.num_requests > 0 and all(n == 1 for n in batch.query_lens)


def pad_decode_batch(batch: ForwardBatch, size: int, scratch_page: int) -> ForwardBatch:
    """`batch` (pure decode) with dummy requests appended up to `size` requests.

    A dummy row is token 0 at position 0 with a one-token KV of its own in `scratch_page`: it
    writes K/V only there and attends only to that, so real rows and real pages are untouched.
    Real rows keep their indices, and logits_indices is unchanged: dummies are never sampled.
    All on the batch's device, no host sync."""
    assert batch.num_requests == 0 or is_pure_decode(batch), "only pure-decode batches are padded"
    pad = size - batch.num_requests
    assert pad >= 0, f"{batch.num_requests} requests do not fit a batch of {size}"
    if pad == 0:
        return batch
    dev = batch.input_ids.device
    steps = torch.arange(1, pad + 1, dtype=torch.int32, device=dev)  # [pad]

    def extend(t: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, tail.to(t.dtype)])

    def fill(value: int) -> torch.Tensor:
        return torch.full((pad,), value, dtype=torch.int64, device=dev)

    return dataclasses.replace(
        batch,
        input_ids=extend(batch.input_ids, fill(0)),
        positions=extend(batch.positions, fill(0)),
        qo_indptr=extend(batch.qo_indptr, steps + batch.num_tokens),
        kv_indptr=extend(batch.kv_indptr, steps + batch.kv_indices.numel()),
        kv_indices=extend(batch.kv_indices, fill(scratch_page)),
        kv_last_page_len=extend(batch.kv_last_page_len, fill(1)),
        slot_mapping=extend(batch.slot_mapping, fill(scratch_page * batch.block_size)),
        query_lens=[*batch.query_lens, *[1] * pad],
        seq_lens=[*batch.seq_lens, *[1] * pad],
        request_ids=[*batch.request_ids, *[PADDING_REQUEST_ID] * pad],
    )


@runtime_checkable
class GraphAttentionBackend(Protocol):
    """An attention backend whose decode can be captured: fixed buffers per batch size, planned
    outside the graph (FlashInferAttentionBackend)."""

    name: str

    def plan(self, batch: ForwardBatch) -> None: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor: ...

    def prepare_graphs(self, batch_sizes: Sequence[int], max_num_pages: int) -> None: ...

    def plan_graph(self, batch: ForwardBatch) -> None: ...


def graphs_disabled_reason(enforce_eager: bool, device: torch.device, backend: AttentionBackend) -> str | None:
    """Why decode runs without CUDA graphs, or None when it can use them."""
    if enforce_eager:
        return "--enforce-eager"
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    if not isinstance(backend, GraphAttentionBackend):
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
    up to the largest bucket, the eager forward for everything else (prefill or mixed batches,
    bigger decode batches, and every batch before `capture()`)."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        buckets: DecodeBuckets,
        scratch_page: int,
        max_pages_per_seq: int,
        capturer: GraphCapturer | None = None,
    ) -> None:
        """`scratch_page` is a KV page no request ever owns (the runner allocates one page more
        than it gives the scheduler); dummy rows write there. Any backend runs eagerly; capture()
        needs a GraphAttentionBackend."""
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
        self._capturer = capturer if capturer is not None else CudaGraphCapturer()
        self._graphs: dict[int, CapturedGraph] = {}
        # The graphs' inputs: fixed addresses, rows [:size] used by the graph of that size.
        self._input_ids = torch.zeros(buckets.largest, dtype=torch.int64, device=self.device)  # [largest]
        self._positions = torch.zeros(buckets.largest, dtype=torch.int64, device=self.device)  # [largest]

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first, each after one eager warm-up run (Triton
        compiles and cuBLAS picks its kernels outside the capture)."""
        start = time.perf_counter()
        assert isinstance(self.backend, GraphAttentionBackend), f"the {self.backend.name} backend cannot be captured"
        self.backend.prepare_graphs(self.buckets.sizes, self.max_num_pages)
        empty = build_forward_batch(SchedulerOutput((), ()), self.block_size, self.device)
        sizes = sorted(self.buckets.sizes, reverse=True)
        for size in tqdm(sizes, desc="capturing CUDA graphs", unit="graph", disable=None):
            self._load_inputs(pad_decode_batch(empty, size, self.scratch_page))
            self._run_static(size)
            try:
                self._graphs[size] = self._capturer.capture(functools.partial(self._run_static, size))
            except RuntimeError as e:
                raise RuntimeError(f"CUDA graph capture failed at batch size {size} ({e}); "
                                   "start with --enforce-eager to run without CUDA graphs") from e
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
                    len(sizes), ",".join(map(str, self.buckets.sizes)), time.perf_counter() - start)

    def graph_size_for(self, batch: ForwardBatch) -> int | None:
        """The captured size this batch replays, or None when it runs eagerly."""
        if not self._graphs or not is_pure_decode(batch):
            return None
        size = self.buckets.bucket_for(batch.num_requests)
        return size if size in self._graphs else None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] of the batch's rows.

        NOTE: after a replay this is a view of the graph's output buffer: the next forward
        overwrites it, so use it (logits) before running another step."""
        size = self.graph_size_for(batch)
        if size is None:
            self.backend.plan(batch)
            return self.model(batch.input_ids, batch.positions, self.kv_caches, self.backend)
        assert batch.kv_indices.numel() <= self.max_num_pages, "a sequence is longer than max_pages_per_seq"
        self._load_inputs(pad_decode_batch(batch, size, self.scratch_page))
        graph = self._graphs[size]
        graph.replay()
        return graph.output[: batch.num_tokens]

    def _load_inputs(self, padded: ForwardBatch) -> None:
        assert isinstance(self.backend, GraphAttentionBackend)
        size = padded.num_requests
        self._input_ids[:size].copy_(padded.input_ids)
        self._positions[:size].copy_(padded.positions)
        self.backend.plan_graph(padded)

    def _run_static(self, size: int) -> torch.Tensor:
        return self.model(self._input_ids[:size], self._positions[:size], self.kv_caches, self.backend)
