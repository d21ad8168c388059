"""The Triton grouped GEMM for block-FP8 experts (W8A8): the float expert kernel's walk in
kernels.fused_moe_triton (slots sorted by expert, each expert's run padded to the row tile, so a
tile reads one expert's weights), with each (slot, group of block_k) of activations quantized in
registers as kernels.fp8_triton does, an fp8 x fp8 dot per group, and the activation and weight
block scales applied to its float32 partial sums. Reference: kernels.fused_moe_fp8.fused_experts_fp8_ref.

UNTESTED ON A DEVICE: checked only under TRITON_INTERPRET=1 (no GPU was lent to the work that
wrote it). NOTE: core builtins only, so (re)importing this module, kernels.fp8_triton and
kernels.fused_moe_triton with TRITON_INTERPRET=1 set is enough to interpret it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from kernels.fp8_block import ACT_EPS, FP8_MAX
from kernels.fp8_triton import quantize_group
from kernels.fused_moe import moe_align_block_size
from kernels.fused_moe_fp8 import Fp8ExpertWeights
from kernels.fused_moe_triton import MoEConfig, choose_moe_config


@triton.jit
def _moe_fp8_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
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
    stride_se,
    stride_sn,
    stride_sk,
    stride_om,
    stride_on,
    SCALE_BLOCK_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    EPS: tl.constexpr,
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
    offs_k = tl.arange(0, GROUP_K)
    scale_rows = (offs_n // SCALE_BLOCK_N).to(tl.int64)
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, GROUP_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(
            x_ptr + row[:, None] * stride_xm + (k0 + offs_k)[None, :] * stride_xk,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        xq, xs = quantize_group(x, FP8_MAX_C, EPS)
        # [GROUP_K, BLOCK_N] of this tile's expert
        w = tl.load(
            w_base + offs_n[None, :].to(tl.int64) * stride_wn + (k0 + offs_k)[:, None] * stride_wk,
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        ws = tl.load(s_base + scale_rows * stride_sn + (k0 // GROUP_K) * stride_sk, mask=n_ok, other=0.0)
        acc += tl.dot(xq, w) * xs[:, None] * ws[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + slot, mask=m_ok, other=0.0)[:, None]
    out = out_ptr + slot.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def grouped_matmul_fp8(
    x: Tensor,
    w: Fp8ExpertWeights,
    sorted_ids: Tensor,
    block_expert: Tensor,
    num_padded: Tensor,
    num_slots: int,
    top_k: int,
    topk_weights: Tensor | None,
    config: MoEConfig,
) -> Tensor:
    """out[s] = W8A8(x[s // top_k], W[expert(s)]) (* topk_weights[s]) for every slot s < num_slots
    -> [num_slots, N] in x.dtype."""
    n, k = w.shape
    assert x.shape[1] == k, f"x has K={x.shape[1]}, experts have K={k}"
    out = torch.empty(num_slots, n, dtype=x.dtype, device=x.device)  # [T*k, N]
    grid = (sorted_ids.numel() // config.block_m, triton.cdiv(n, config.block_n))
    weights = topk_weights if topk_weights is not None else w.scale  # unread when not multiplied
    _moe_fp8_kernel[grid](
        x,
        w.codes,
        w.scale,
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
        w.codes.stride(0),
        w.codes.stride(1),
        w.codes.stride(2),
        w.scale.stride(0),
        w.scale.stride(1),
        w.scale.stride(2),
        out.stride(0),
        out.stride(1),
        SCALE_BLOCK_N=w.block_n,
        GROUP_K=w.block_k,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        MUL_WEIGHT=topk_weights is not None,
        FP8_MAX_C=FP8_MAX,
        EPS=ACT_EPS,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def fused_experts_fp8_triton(
    x: Tensor,
    w13: Fp8ExpertWeights,
    w2: Fp8ExpertWeights,
    topk_weights: Tensor,
    topk_ids: Tensor,
    *,
    config: MoEConfig | None = None,
) -> Tensor:
    """x [T, H] -> [T, H] in x.dtype: sort once, gate/up grouped GEMM, SwiGLU, down grouped GEMM
    with the routing weight in its epilogue, then the k slots of each token summed."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.empty_like(x)
    num_slots = num_tokens * top_k
    config = config or choose_moe_config(num_slots, w13.num_experts)
    sorted_ids, block_expert, num_padded = moe_align_block_size(topk_ids, config.block_m, w13.num_experts)
    x = x.contiguous()
    gate_up = grouped_matmul_fp8(x, w13, sorted_ids, block_expert, num_padded, num_slots, top_k, None, config)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = (F.silu(gate) * up).contiguous()  # [T*k, I]
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    down = grouped_matmul_fp8(hidden, w2, sorted_ids, block_expert, num_padded, num_slots, 1, weights, config)
    return down.view(num_tokens, top_k, -1).sum(dim=1)
