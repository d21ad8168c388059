"""The FlashInfer attention backend (CUDA): planned once per step from the same `ForwardBatch` the
torch reference reads. Mixed prefill/decode batches run FlashInfer's paged prefill kernel (ragged
qo_indptr); pure decode batches its decode kernel; CUDA-graph decode has one decode wrapper per
captured batch size over shared fixed buffers, and CUDA-graph verify steps (every request 1 + k
query rows) one graph-mode prefill wrapper per batch size over fixed buffers of their own.

flashinfer is imported in the constructor only, so this module imports on any machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from engine.batch import ForwardBatch

# The float workspace holds split-KV partial outputs; shared by every wrapper because their runs
# never overlap (one stream, one step at a time). FlashInfer recommends 128 MiB; 256 MiB leaves
# room for batch 512 with long contexts.
WORKSPACE_BYTES = 256 << 20
# Above this many query heads per KV head FlashInfer's tensor-core (prefill-kernel) decode beats
# its CUDA-core decode kernel; vLLM uses the same cut.
TENSOR_CORE_DECODE_MIN_GROUP = 5
FA3_HEAD_DIMS = (64, 128, 256)


def decode_uses_tensor_cores(num_qo_heads: int, num_kv_heads: int) -> bool:
    return num_qo_heads // num_kv_heads >= TENSOR_CORE_DECODE_MIN_GROUP


def prefill_backend_for(capability: tuple[int, int], head_dim: int) -> str:
    """The paged-prefill kernel family: "fa3" (Hopper wgmma/TMA) on SM90 for the head dims it
    instantiates, else "fa2". Mirrors FlashInfer's own `auto` for bf16/fp16 without RoPE or a
    custom mask, but is decided here so the bundle prebuilds exactly what runs."""
    return "fa3" if capability[0] == 9 and head_dim in FA3_HEAD_DIMS else "fa2"


@dataclass(frozen=True)
class HostMetadata:
    """The indptr-like metadata FlashInfer's plan() reads on the host, rebuilt from the batch's host
    lists so planning never waits on the device (the device copies live in `ForwardBatch`)."""

    qo_indptr: torch.Tensor  # [B+1] int32, cpu
    kv_indptr: torch.Tensor  # [B+1] int32, cpu
    kv_last_page_len: torch.Tensor  # [B] int32, cpu


def host_metadata(batch: ForwardBatch) -> HostMetadata:
    bs = batch.block_size
    num_pages = [-(-n // bs) for n in batch.seq_lens]
    qo = torch.zeros(batch.num_requests + 1, dtype=torch.int32)
    kv = torch.zeros(batch.num_requests + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(batch.query_lens, dtype=torch.int32), 0, out=qo[1:])
    torch.cumsum(torch.tensor(num_pages, dtype=torch.int32), 0, out=kv[1:])
    last = [n - (p - 1) * bs for n, p in zip(batch.seq_lens, num_pages)]
    return HostMetadata(qo, kv, torch.tensor(last, dtype=torch.int32))


def cache_rows(slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """[T] int64 rows of the K entries in the flat view [P * 2 * block_size, Hkv, D] of the cache;
    the V entry of a slot is its K row + block_size. The same write as the torch backend's."""
    page = torch.div(slot_mapping, block_size, rounding_mode="floor")
    return page * (2 * block_size) + slot_mapping % block_size


class FlashInferAttentionBackend:
    name = "flashinfer"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        capability: tuple[int, int] | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
        api: ModuleType | None = None,
    ) -> None:
        """`api` is the flashinfer module (a stand-in in CPU tests); `capability` defaults to the
        device's compute capability."""
        if api is None:
            import flashinfer as api
        self._fi = api
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        if capability is None:
            capability = torch.cuda.get_device_capability(device)
        self.use_tensor_cores = decode_uses_tensor_cores(num_heads, num_kv_heads)
        self.prefill_backend = prefill_backend_for(capability, head_dim)
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)  # [bytes] uint8
        self._prefill = api.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend=self.prefill_backend)
        self._decode = self._decode_wrapper()
        # What forward() uses this step: the planned wrapper and the flat cache rows new K/V go to.
        self._wrapper: Any = None
        self._k_rows: torch.Tensor | None = None  # [T] int64
        self._v_rows: torch.Tensor | None = None  # [T] int64
        # CUDA-graph state (prepare_graphs): one decode wrapper per captured batch size.
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_k_rows: torch.Tensor | None = None  # [largest] int64, fixed address
        self._graph_v_rows: torch.Tensor | None = None
        # Verify-step graphs (prepare_verify_graphs): one prefill wrapper per batch size, q_len fixed.
        self._verify_wrappers: dict[int, Any] = {}
        self._verify_query_len = 0
        self._verify_k_rows: torch.Tensor | None = None  # [largest * q_len] int64, fixed address
        self._verify_v_rows: torch.Tensor | None = None

    def _decode_wrapper(self, **graph_buffers: torch.Tensor) -> Any:
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace,
            "NHD",
            use_cuda_graph=bool(graph_buffers),
            use_tensor_cores=self.use_tensor_cores,
            backend="fa2",  # pinned, not "auto": the bundle prebuilds the fa2 decode module
            **graph_buffers,
        )

    def _plan_kwargs(self) -> dict[str, object]:
        return dict(q_data_type=self.dtype, kv_data_type=self.dtype)

    def plan(self, batch: ForwardBatch) -> None:
        assert batch.num_requests > 0, "plan() needs at least one request"
        meta = host_metadata(batch)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim, self.block_size)
        if all(n == 1 for n in batch.query_lens):
            self._decode.plan(meta.kv_indptr, batch.kv_indices, meta.kv_last_page_len, *heads, **self._plan_kwargs())
            self._wrapper = self._decode
        else:
            # Decode rows ride along as qo_len=1 requests; FlashInfer's causal mask is aligned to
            # the end of each request's KV, which is the chunked-prefill mask.
            self._prefill.plan(
                meta.qo_indptr,
                meta.kv_indptr,
                batch.kv_indices,
                meta.kv_last_page_len,
                *heads,
                causal=True,
                **self._plan_kwargs(),
            )
            self._wrapper = self._prefill
        self._k_rows = cache_rows(batch.slot_mapping, self.block_size)
        self._v_rows = self._k_rows + self.block_size

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        assert self._k_rows is not None and self._v_rows is not None, "plan() or plan_graph() must run before forward()"
        flat = kv_cache.view(-1, kv_cache.shape[-2], kv_cache.shape[-1])  # [P*2*bs, Hkv, D]
        # Every new K/V of the batch is written before any is read (same-step prefix hits).
        flat.index_copy_(0, self._k_rows, k.to(flat.dtype))
        flat.index_copy_(0, self._v_rows, v.to(flat.dtype))
        return self._wrapper.run(q, kv_cache)  # [T, Hq, D]

    # ---- CUDA graphs -------------------------------------------------------------------------
    def prepare_graphs(self, batch_sizes: Sequence[int], max_num_pages: int) -> None:
        """One graph-mode decode wrapper per batch size, all over one set of fixed buffers sized
        for the largest (a captured kernel reads the addresses it was captured with)."""
        largest = max(batch_sizes)
        dev = self.device
        indptr = torch.zeros(largest + 1, dtype=torch.int32, device=dev)
        last_page_len = torch.zeros(largest, dtype=torch.int32, device=dev)
        indices = torch.zeros(max_num_pages, dtype=torch.int32, device=dev)
        self._graph_k_rows = torch.zeros(largest, dtype=torch.int64, device=dev)
        self._graph_v_rows = torch.zeros(largest, dtype=torch.int64, device=dev)
        self._graph_wrappers = {
            size: self._decode_wrapper(
                paged_kv_indptr_buffer=indptr[: size + 1],
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last_page_len[:size],
            )
            for size in batch_sizes
        }

    def prepare_verify_graphs(self, batch_sizes: Sequence[int], query_len: int, max_num_pages: int) -> None:
        """One graph-mode prefill wrapper per batch size for verify steps of `query_len` rows per
        request, over one set of fixed buffers sized for the largest."""
        largest = max(batch_sizes)
        dev = self.device
        qo_indptr = torch.zeros(largest + 1, dtype=torch.int32, device=dev)
        kv_indptr = torch.zeros(largest + 1, dtype=torch.int32, device=dev)
        last_page_len = torch.zeros(largest, dtype=torch.int32, device=dev)
        indices = torch.zeros(max_num_pages, dtype=torch.int32, device=dev)
        self._verify_query_len = query_len
        self._verify_k_rows = torch.zeros(largest * query_len, dtype=torch.int64, device=dev)
        self._verify_v_rows = torch.zeros(largest * query_len, dtype=torch.int64, device=dev)
        self._verify_wrappers = {
            size: self._fi.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=qo_indptr[: size + 1],
                paged_kv_indptr_buf=kv_indptr[: size + 1],
                paged_kv_indices_buf=indices,
                paged_kv_last_page_len_buf=last_page_len[:size],
                backend=self.prefill_backend,
            )
            for size in batch_sizes
        }

    def plan_graph(self, batch: ForwardBatch) -> None:
        """Plan a batch already padded to a prepared size, pure decode or a verify step (outside the
        graph: plan() copies into the fixed buffers); forward() inside the graph then reads only those."""
        size, query_len = batch.num_requests, batch.query_lens[0]
        assert all(n == query_len for n in batch.query_lens), "a graph batch has the same rows per request"
        meta = host_metadata(batch)
        heads = (self.num_heads, self.num_kv_heads, self.head_dim, self.block_size)
        if query_len == 1:
            wrapper = self._graph_wrappers.get(size)
            assert wrapper is not None, f"no graph wrapper for batch size {size}: prepare_graphs() first"
            k_rows, v_rows = self._graph_k_rows, self._graph_v_rows
            wrapper.plan(meta.kv_indptr, batch.kv_indices, meta.kv_last_page_len, *heads, **self._plan_kwargs())
        else:
            wrapper = self._verify_wrappers.get(size)
            assert wrapper is not None and query_len == self._verify_query_len, (
                f"no verify graph wrapper for {size} x {query_len} rows: prepare_verify_graphs() first"
            )
            k_rows, v_rows = self._verify_k_rows, self._verify_v_rows
            wrapper.plan(
                meta.qo_indptr,
                meta.kv_indptr,
                batch.kv_indices,
                meta.kv_last_page_len,
                *heads,
                causal=True,
                **self._plan_kwargs(),
            )
        assert k_rows is not None and v_rows is not None
        num_tokens = size * query_len
        rows = cache_rows(batch.slot_mapping, self.block_size)
        k_rows[:num_tokens].copy_(rows)
        v_rows[:num_tokens].copy_(rows + self.block_size)
        self._k_rows = k_rows[:num_tokens]
        self._v_rows = v_rows[:num_tokens]
        self._wrapper = wrapper
