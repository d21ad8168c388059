"""Paged attention on CPU without a gather: the C++ ops of `cpu_attention.cpp`
(`torch.ops.fp4serve_cpu.paged_attention`, `.reshape_and_cache`) and of `cpu_fused_attention.cpp`
(`.rope_cache_attention`: RoPE, the cache write and the attention as one op), compiled and loaded
by kernels/cpu_ops.py, and the pure-torch references the tests hold them to."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.cpu_elementwise import rotary_ref


def paged_attention(
    q: Tensor,
    kv_cache: Tensor,
    qo_indptr: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    scale: float,
) -> Tensor:
    """q [T, Hq, D] -> [T, Hq, D] in q's dtype, every request causal over its pages (the C++ op)."""
    return torch.ops.fp4serve_cpu.paged_attention.default(
        q, kv_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scale
    )


def reshape_and_cache(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """k/v [T, Hkv, D] into kv_cache [P, 2, bs, Hkv, D] at slot_mapping [T] int64 (the C++ op)."""
    torch.ops.fp4serve_cpu.reshape_and_cache.default(k, v, kv_cache, slot_mapping)


def rope_cache_attention(
    qkv: Tensor,
    cos: Tensor,
    signed_sin: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    qo_indptr: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    num_heads: int,
    scale: float,
) -> Tensor:
    """A decode layer's attention from its fused projection: qkv [T, (Hq + 2 Hkv) * D] -> [T, Hq * D];
    q and k rotated (cos/signed_sin [T, D], as kernels/cpu_elementwise.rotary), k and v written to
    the cache at slot_mapping, then `paged_attention` (the C++ op of cpu_fused_attention.cpp)."""
    return torch.ops.fp4serve_cpu.rope_cache_attention.default(
        qkv,
        cos,
        signed_sin,
        kv_cache,
        slot_mapping,
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        num_heads,
        scale,
    )


def paged_attention_ref(
    q: Tensor,
    kv_cache: Tensor,
    qo_indptr: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    scale: float,
) -> Tensor:
    """The reference: per request, gather its keys and values, then float32 SDPA with a causal
    mask offset by the keys already cached; out in q's dtype."""
    bs = kv_cache.shape[2]
    out = torch.empty_like(q)
    qo, kv_ptr, last = qo_indptr.tolist(), kv_indptr.tolist(), kv_last_page_len.tolist()
    for i in range(len(qo) - 1):
        pages = kv_indices[kv_ptr[i] : kv_ptr[i + 1]].long()
        seq_len = (len(pages) - 1) * bs + last[i]
        keys = kv_cache[pages, 0].flatten(0, 1)[:seq_len].float()  # [L, Hkv, D]
        values = kv_cache[pages, 1].flatten(0, 1)[:seq_len].float()
        rows = q[qo[i] : qo[i + 1]].float()  # [Lq, Hq, D]
        q_len = rows.shape[0]
        mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]  # [Lq, L]
        o = F.scaled_dot_product_attention(
            rows.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[qo[i] : qo[i + 1]] = o[0].transpose(0, 1).to(q.dtype)
    return out


def reshape_and_cache_ref(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """The reference: index_copy_ of each row, cast to the cache's dtype, at its slot."""
    bs = kv_cache.shape[2]
    flat = kv_cache.view(-1, *kv_cache.shape[3:])  # [P * 2 * bs, Hkv, D]
    rows = torch.div(slot_mapping, bs, rounding_mode="floor") * (2 * bs) + slot_mapping % bs
    flat.index_copy_(0, rows, k.to(kv_cache.dtype))
    flat.index_copy_(0, rows + bs, v.to(kv_cache.dtype))


def rope_cache_attention_ref(
    qkv: Tensor,
    cos: Tensor,
    signed_sin: Tensor,
    kv_cache: Tensor,
    slot_mapping: Tensor,
    qo_indptr: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    num_heads: int,
    scale: float,
) -> Tensor:
    """The reference: the fused op's steps through the references above."""
    rows, kv_heads, d = qkv.shape[0], kv_cache.shape[3], kv_cache.shape[4]
    qk = rotary_ref(qkv[:, : (num_heads + kv_heads) * d].reshape(rows, -1, d), cos, signed_sin)
    v = qkv[:, (num_heads + kv_heads) * d :].reshape(rows, kv_heads, d)
    reshape_and_cache_ref(qk[:, num_heads:], v, kv_cache, slot_mapping)
    out = paged_attention_ref(
        qk[:, :num_heads].contiguous(), kv_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, scale
    )
    return out.reshape(rows, num_heads * d)
