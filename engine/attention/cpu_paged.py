"""The CPU attention backend: decode rows and short chunks attend over the paged KV cache in place
through the C++ ops of kernels/cpu_attention.py (no per-layer gather of K and V); longer prefill
chunks keep the torch reference's path over their gathered keys (a compute-bound case where
torch's flash kernel is the faster one; torch_ref.chunk_attention: no mask, earlier keys and the
chunk's own merged by log-sum-exp). engine/host/cpu_kernels.py compiles the ops once per machine."""

from __future__ import annotations

import torch

from engine.attention.torch_ref import TorchAttentionBackend
from engine.batch import ForwardBatch
from kernels.cpu_attention import paged_attention, reshape_and_cache, rope_cache_attention
from kernels.cpu_ops import ops_loaded

# Requests with at most this many query rows (decodes, speculative verify rows, short prompt
# chunks) attend through the C++ op; longer chunks through SDPA.
OP_MAX_QUERY_ROWS = 16
# (query dtype, cache dtype) pairs the C++ op is built for.
SUPPORTED_DTYPES = {
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16),
    (torch.float32, torch.float16),
}


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device) -> None:
        assert ops_loaded(), "engine.host.cpu_kernels.load_cpu_ops() first"
        self.num_heads = num_heads
        self.scale = head_dim**-0.5
        self.ref = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, device)  # longer prefill chunks
        self._slots: torch.Tensor | None = None  # [T] int64
        # The op's metadata: (qo_indptr, kv_indptr, kv_indices, kv_last_page_len), int32, over the
        # requests it serves; `_rows` [R] int64 picks their query rows out of the batch (None: all).
        self._meta: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._rows: torch.Tensor | None = None
        self._has_prefills = False

    def plan(self, batch: ForwardBatch) -> None:
        self._slots = batch.slot_mapping
        self._rows = None
        self._has_prefills = max(batch.query_lens, default=0) > OP_MAX_QUERY_ROWS
        if not self._has_prefills:  # decodes and short chunks only: the batch's own metadata, no host work
            self._meta = (batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
            return
        self.ref.plan_prefills(batch, OP_MAX_QUERY_ROWS + 1)
        short = [i for i, n in enumerate(batch.query_lens) if n <= OP_MAX_QUERY_ROWS]
        self._meta = None
        if not short:
            return
        qo, kv_ptr = batch.qo_indptr.tolist(), batch.kv_indptr.tolist()
        kv_idx, last = batch.kv_indices.tolist(), batch.kv_last_page_len.tolist()
        rows: list[int] = []
        sub_qo, sub_kv_ptr, sub_kv_idx = [0], [0], []
        for i in short:
            rows.extend(range(qo[i], qo[i + 1]))
            sub_qo.append(len(rows))
            sub_kv_idx.extend(kv_idx[kv_ptr[i] : kv_ptr[i + 1]])
            sub_kv_ptr.append(len(sub_kv_idx))
        dev = batch.qo_indptr.device

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=dev)

        self._rows = torch.tensor(rows, dtype=torch.int64, device=dev)
        self._meta = (i32(sub_qo), i32(sub_kv_ptr), i32(sub_kv_idx), i32([last[i] for i in short]))

    def attend_qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, kv_cache: torch.Tensor, num_heads: int
    ) -> torch.Tensor | None:
        """A step without prefill chunks: qkv [T, (Hq + 2 Hkv) * D], the fused projection's rows, to
        the attention's output [T, Hq * D] in one op (RoPE by cos/signed_sin [T, D], the cache
        write, the attention: kernels/cpu_fused_attention.cpp). None when the step has prefill
        chunks (the caller then rotates and calls `forward`)."""
        meta = self.decode_meta()
        return (
            None if meta is None else rope_cache_attention(qkv, cos, signed_sin, kv_cache, *meta, num_heads, self.scale)
        )

    def decode_meta(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(slot_mapping, qo_indptr, kv_indptr, kv_indices, kv_last_page_len) of a step without prefill
        chunks, as kernels/cpu_fused_attention.cpp takes them; None for a step with some."""
        if self._has_prefills:
            return None
        assert self._slots is not None and self._meta is not None, "plan() must run first"
        return (self._slots, *self._meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        assert self._slots is not None, "plan() must run before forward()"
        reshape_and_cache(k, v, kv_cache, self._slots)  # every new K/V first: same-step prefix hits read them
        if not self._has_prefills:
            assert self._meta is not None
            return paged_attention(q, kv_cache, *self._meta, self.scale)
        out = torch.empty_like(q)
        if self._meta is not None and self._rows is not None:
            out[self._rows] = paged_attention(q.index_select(0, self._rows), kv_cache, *self._meta, self.scale)
        self.ref.attend_prefills(q, kv_cache, out)
        return out
