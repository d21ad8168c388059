"""The Triton fused-MoE kernels: a grouped GEMM over the (token, slot) pairs sorted by expert
with each expert's run padded to the row tile (`moe_align_block_size`), so every tile reads one
expert's weights; bf16/fp16 experts, or NVFP4 W4A16 experts decoded in registers as in
kernels.nvfp4_triton. Reference: `kernels.fused_moe.fused_experts_ref`.

UNTESTED ON A DEVICE: checked only under TRITON_INTERPRET=1 with fp16 operands (no GPU was lent to
the work that wrote it). NOTE: as in nvfp4_triton, the kernels use core builtins only, so
(re)importing this module with TRITON_INTERPRET=1 set is enough to interpret them."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kernels.fused_moe import NVFP4ExpertWeights, moe_align_block_size
from kernels.nvfp4_triton import CHUNK_K, KernelLayout, decode_group, default_dot_dtype, pack_kernel_layout


@dataclass(frozen=True)
class ExpertKernelLayout:
    """Every expert's NVFP4 weight [N, K] in `KernelLayout`'s word layout, stacked on dim 0."""

    words: Tensor  # [E, N, K_pad / 8] int32
    scale_words: Tensor  # [E, N, K_pad / 64] int32
    row_global_scale: Tensor  # [E, N] float32
    k: int

    @property
    def num_experts(self) -> int:
        return self.words.shape[0]

    @property
    def n(self) -> int:
        return self.words.shape[1]


def pack_expert_layout(w: NVFP4ExpertWeights) -> ExpertKernelLayout:
    """Re-lay every expert at once: the experts' rows are just more rows to `pack_kernel_layout`."""
    e, n, half_k = w.packed.shape
    flat: KernelLayout = pack_kernel_layout(
        w.packed.reshape(e * n, half_k), w.block_scale.reshape(e * n, -1), w.row_global_scale().reshape(e * n)
    )
    return ExpertKernelLayout(
        flat.words.reshape(e, n, -1), flat.scale_words.reshape(e, n, -1), flat.row_global_scale.reshape(e, n), flat.k
    )


@dataclass(frozen=True)
class MoEConfig:
    """Tiles. block_m is also the padding of each expert's run of sorted rows."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64  # float experts only; NVFP4 walks K in CHUNK_K steps
    num_warps: int = 4
    num_stages: int = 3


def choose_moe_config(num_slots: int, num_experts: int) -> MoEConfig:
    """A row tile near the average rows per expert: decode (a few tokens spread over 128 experts)
    wants 16, padding every expert's run to 64 would multiply the work."""
    average = num_slots / max(num_experts, 1)
    block_m = 16 if average <= 16 else 32 if average <= 32 else 64
    return MoEConfig(block_m=block_m, block_n=64 if block_m < 64 else 128, num_warps=4 if block_m < 64 else 8)


@triton.jit
def _moe_float_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    topk_w_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    N,
    K,
    num_valid,
    top_k,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # a tile past the last expert's padded run
    slot = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M] flat t*k+j
    m_ok = slot < num_valid  # padding rows hold num_valid
    row = (slot // top_k).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(
            x_ptr + row[:, None] * stride_xm + (k0 + offs_k)[None, :] * stride_xk,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        # [BLOCK_K, BLOCK_N] of this tile's expert
        w = tl.load(
            w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk,
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc)
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + slot, mask=m_ok, other=0.0)[:, None]
    out = out_ptr + slot.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_nvfp4_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    g_ptr,
    out_ptr,
    topk_w_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    N,
    K,
    k_pad,
    num_valid,
    top_k,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ge,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    # Weight rows are the dot's left side ("swap AB"), as in nvfp4_triton._w4a16_kernel, whose
    # word layout and in-register decode this shares.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    slot = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = slot < num_valid
    row = (slot // top_k).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_word = tl.arange(0, 8)
    offs_j = tl.arange(0, 16)
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    for k0 in range(0, k_pad, 128):
        for half in tl.static_range(2):  # scale groups 0-3, then 4-7
            words = tl.load(
                w_base + offs_n[:, None] * stride_wn + (k0 // 8 + 8 * half + offs_word)[None, :],
                mask=n_ok[:, None],
                other=0,
            ).to(tl.uint32, bitcast=True)
            scales = tl.load(s_base + offs_n * stride_sn + k0 // 64 + half, mask=n_ok, other=0)
            for q in tl.static_range(4):
                w = decode_group(words, scales, q, BLOCK_N, DOT_DTYPE)
                offs_k = k0 + 16 * (4 * half + q) + offs_j
                if EVEN_K:
                    x_ok = m_ok[None, :]
                else:
                    x_ok = m_ok[None, :] & (offs_k < K)[:, None]
                x_t = tl.load(x_ptr + row[None, :] * stride_xm + offs_k[:, None] * stride_xk, mask=x_ok, other=0.0)
                acc = tl.dot(w, x_t.to(DOT_DTYPE), acc)
    acc = acc * 16384.0 / tl.load(g_ptr + expert * stride_ge + offs_n, mask=n_ok, other=1.0)[:, None]
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + slot, mask=m_ok, other=0.0)[None, :]
    out = out_ptr + slot.to(tl.int64)[None, :] * stride_om + offs_n[:, None] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def _tl_dtype(dtype: torch.dtype) -> tl.dtype:
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def grouped_matmul(
    x: Tensor,
    w: Tensor | ExpertKernelLayout,
    sorted_ids: Tensor,
    block_expert: Tensor,
    num_padded: Tensor,
    num_slots: int,
    top_k: int,
    topk_weights: Tensor | None,
    config: MoEConfig,
    dot_dtype: torch.dtype,
) -> Tensor:
    """out[s] = x[s // top_k] @ W[expert(s)]^T (* topk_weights[s]) for every slot s < num_slots
    -> [num_slots, N] in x.dtype. w: float [E, N, K] or NVFP4 re-laid."""
    n = w.n if isinstance(w, ExpertKernelLayout) else w.shape[1]
    k = x.shape[1]
    out = torch.empty(num_slots, n, dtype=x.dtype, device=x.device)  # [T*k, N]
    grid = (sorted_ids.numel() // config.block_m, triton.cdiv(n, config.block_n))
    weights = topk_weights if topk_weights is not None else sorted_ids  # unread when not multiplied
    if isinstance(w, ExpertKernelLayout):
        assert k == w.k, f"x has K={k}, experts have K={w.k}"
        chunks = triton.cdiv(k, CHUNK_K)
        _moe_nvfp4_kernel[grid](
            x,
            w.words,
            w.scale_words,
            w.row_global_scale,
            out,
            weights,
            sorted_ids,
            block_expert,
            num_padded,
            n,
            k,
            chunks * CHUNK_K,
            num_slots,
            top_k,
            x.stride(0),
            x.stride(1),
            w.words.stride(0),
            w.words.stride(1),
            w.scale_words.stride(0),
            w.scale_words.stride(1),
            w.row_global_scale.stride(0),
            out.stride(0),
            out.stride(1),
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            EVEN_K=k % CHUNK_K == 0,
            MUL_WEIGHT=topk_weights is not None,
            DOT_DTYPE=_tl_dtype(dot_dtype),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        return out
    assert k == w.shape[2], f"x has K={k}, experts have K={w.shape[2]}"
    _moe_float_kernel[grid](
        x,
        w,
        out,
        weights,
        sorted_ids,
        block_expert,
        num_padded,
        n,
        k,
        num_slots,
        top_k,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        MUL_WEIGHT=topk_weights is not None,
        DOT_DTYPE=_tl_dtype(dot_dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def fused_experts_triton(
    x: Tensor,
    w13: Tensor | ExpertKernelLayout,
    w2: Tensor | ExpertKernelLayout,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    config: MoEConfig | None = None,
    dot_dtype: torch.dtype | None = None,
) -> Tensor:
    """x [T, H] -> [T, H] in x.dtype: sort once, gate/up grouped GEMM, SwiGLU, down grouped GEMM
    with the routing weight in its epilogue, then the k slots of each token summed."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.empty_like(x)
    num_experts = w13.num_experts if isinstance(w13, ExpertKernelLayout) else w13.shape[0]
    num_slots = num_tokens * top_k
    config = config or choose_moe_config(num_slots, num_experts)
    dot_dtype = dot_dtype or default_dot_dtype(x)
    sorted_ids, block_expert, num_padded = moe_align_block_size(topk_ids, config.block_m, num_experts)
    x = x.contiguous()
    gate_up = grouped_matmul(
        x, w13, sorted_ids, block_expert, num_padded, num_slots, top_k, None, config, dot_dtype
    )  # [T*k, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = F.silu(gate) * up  # [T*k, I]
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    down = grouped_matmul(
        hidden, w2, sorted_ids, block_expert, num_padded, num_slots, 1, weights, config, dot_dtype
    )  # [T*k, H], weighted
    return down.view(num_tokens, top_k, -1).sum(dim=1)
