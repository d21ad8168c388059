"""The Triton W8A8 block-FP8 GEMM: x [M, K] (bf16/fp16/fp32) times block-FP8 weights, the
activations quantized in registers per (token, group of block_k) exactly as
`kernels.fp8_block.quantize_activation_groups` does, one fp8 x fp8 dot per group (FP8 tensor cores
on SM89+), scaled by the activation group's scale times the weight block's. Reference:
`kernels.fp8_block.w8a8_block_matmul_ref`.

UNTESTED ON A DEVICE: checked only under TRITON_INTERPRET=1 (no GPU was lent to the work that
wrote it). NOTE: core builtins and jit functions of ours only, so (re)importing this module with
TRITON_INTERPRET=1 set is enough to interpret it. Each N tile re-quantizes its rows' activations (cheap
next to the dot; a
separate quantization pass would write and re-read them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.fp8_block import ACT_EPS, FP8_MAX, Fp8BlockWeight


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int = 16
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


def choose_fp8_config(m: int) -> Fp8GemmConfig:
    """Decode rows (a few) take the smallest row tile tl.dot allows; prefill takes wider tiles."""
    if m <= 16:
        return Fp8GemmConfig(16, 64, 4)
    if m <= 64:
        return Fp8GemmConfig(32, 128, 4)
    return Fp8GemmConfig(64, 128, 8)


@triton.jit
def round_to_e4m3(v):
    """float32 -> the nearest e4m3 value (ties to even), still float32, so the cast after it is exact.

    NOTE: done by hand because Triton's interpreter rounds float32 -> fp8e4nv wrongly where the
    mantissa carries into the exponent (7.95 -> 4.0); on a GPU the hardware cast would do. Normal
    range: round the float32 mantissa to 3 bits on its bit pattern (a carry moves the exponent up,
    as it should); e4m3 subnormals (|v| < 2^-6) sit on a fixed 2^-9 grid: the add-and-subtract of
    1.5 * 2^14 rounds to it."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = (v + 24576.0) - 24576.0
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def quantize_group(x, FP8_MAX_C: tl.constexpr, EPS: tl.constexpr):
    """x [R, G] float32 -> (codes [R, G] fp8 e4m3, scales [R] float32), one scale per row.
    NOTE: `tl.reduce` with a combine function of ours, not `tl.max`: that one is triton's own jit
    function, which stays compiled when this module alone is re-imported to be interpreted."""
    scale = tl.maximum(tl.reduce(tl.abs(x), 1, _larger), EPS) / FP8_MAX_C
    q = round_to_e4m3(x / scale[:, None])
    q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _w8a8_block_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_om,
    stride_on,
    SCALE_BLOCK_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP8_MAX_C: tl.constexpr,
    EPS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUP_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    scale_rows = (offs_n // SCALE_BLOCK_N).to(tl.int64)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, GROUP_K):
        k_ok = (k0 + offs_k) < K
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :] * stride_xk,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        xq, xs = quantize_group(x, FP8_MAX_C, EPS)  # [BLOCK_M, GROUP_K] fp8, [BLOCK_M]
        # [GROUP_K, BLOCK_N] fp8 codes of this tile's rows
        w = tl.load(
            w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k0 + offs_k)[:, None] * stride_wk,
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        ws = tl.load(s_ptr + scale_rows * stride_sn + (k0 // GROUP_K) * stride_sk, mask=n_ok, other=0.0)
        part = tl.dot(xq, w)  # [BLOCK_M, BLOCK_N] float32
        acc += part * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def w8a8_block_matmul(
    x: Tensor, w: Fp8BlockWeight, bias: Tensor | None = None, *, config: Fp8GemmConfig | None = None
) -> Tensor:
    """x [M, K] -> [M, N] in x.dtype (x contiguous in K)."""
    m, k = x.shape
    n = w.shape[0]
    assert k == w.shape[1], f"x has K={k}, the weight K={w.shape[1]}"
    config = config or choose_fp8_config(m)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))
    _w8a8_block_kernel[grid](
        x,
        w.codes,
        w.scale,
        bias if bias is not None else w.scale,
        out,
        m,
        n,
        k,
        x.stride(0),
        x.stride(1),
        w.codes.stride(0),
        w.codes.stride(1),
        w.scale.stride(0),
        w.scale.stride(1),
        out.stride(0),
        out.stride(1),
        SCALE_BLOCK_N=w.block_n,
        GROUP_K=w.block_k,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        HAS_BIAS=bias is not None,
        FP8_MAX_C=FP8_MAX,
        EPS=ACT_EPS,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
