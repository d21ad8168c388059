"""NVFP4 `KernelLayout` -> a dense [N, K] weight on the GPU, for prefill-sized batches, where a
cuBLAS GEMM on a dequantized scratch copy can beat the in-register W4A16 kernel: the matmul's
FLOPs then outweigh the 2 bytes per weight the scratch costs to write and read. The scratch is
a temporary of the call; only the packed layout stays resident. Reference:
`kernels.nvfp4.dequantize_nvfp4` (bit-identical)."""

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.nvfp4_triton import CHUNK_K, KernelLayout

# NOTE: core builtins only (see the NOTE in kernels.nvfp4_triton).

_BLOCK_N = 32  # weight rows per program
_HALVES = 4  # half chunks (64 K) per program: 256 K, 128 bytes of codes per row


@triton.jit
def _dequant_kernel(
    w_ptr,
    s_ptr,
    g_ptr,
    out_ptr,
    N,
    K,
    k_pad,
    stride_wn,
    stride_sn,
    stride_on,
    BLOCK_N: tl.constexpr,
    HALVES: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.program_id(1) * HALVES + tl.arange(0, HALVES)
    offs_word = tl.arange(0, 8)
    offs_t = tl.arange(0, 16)
    n_ok = offs_n < N
    h_ok = n_ok[:, None] & (offs_h < k_pad // 64)[None, :]
    words = tl.load(
        w_ptr + offs_n[:, None, None] * stride_wn + offs_h[None, :, None] * 8 + offs_word[None, None, :],
        mask=h_ok[:, :, None],
        other=0,
    ).to(tl.uint32, bitcast=True)  # [BLOCK_N, HALVES, 8]
    scales = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_h[None, :], mask=h_ok, other=0)  # [BLOCK_N, HALVES]
    global_scale = tl.load(g_ptr + offs_n, mask=n_ok, other=1.0)  # [BLOCK_N] fp32: S of each row
    for q in tl.static_range(4):
        shifted = words << (4 * q)
        pair = (shifted & 0x80008000) | ((shifted >> 3) & 0x0E000E00)
        bits = tl.join((pair & 0xFFFF).to(tl.uint16), (pair >> 16).to(tl.uint16))  # [BLOCK_N, HALVES, 8, 2]
        scale_bits = ((scales >> (8 * q)) & 0xFF).to(tl.uint16) << 7
        scale = scale_bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0  # [BLOCK_N, HALVES] sf
        # e2m1 * 2**-14 * sf is exact in fp32; then one division by S, correctly rounded
        # (div_rn, not the approximate `/`), as the reference does it.
        value = bits.to(tl.float16, bitcast=True).to(tl.float32) * scale[:, :, None, None] * 16384.0
        value = tl.math.div_rn(value, global_scale[:, None, None, None])
        value = value.reshape(BLOCK_N, HALVES, 16)
        offs_k = offs_h[None, :, None] * 64 + 16 * q + offs_t[None, None, :]  # [1, HALVES, 16]
        tl.store(
            out_ptr + offs_n[:, None, None] * stride_on + offs_k,
            value.to(out_ptr.dtype.element_ty),
            mask=n_ok[:, None, None] & (offs_k < K),
        )


def dequantize_layout(layout: KernelLayout, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """[N, K] `dtype` on the layout's device: e2m1 * block_scale / S, equal to
    `dequantize_nvfp4` of the weight the layout was packed from."""
    n, k = layout.n, layout.k
    out = torch.empty(n, k, dtype=dtype, device=layout.words.device)  # [N, K] scratch
    k_pad = triton.cdiv(k, CHUNK_K) * CHUNK_K
    grid = (triton.cdiv(n, _BLOCK_N), triton.cdiv(k_pad // 64, _HALVES))
    _dequant_kernel[grid](
        layout.words,
        layout.scale_words,
        layout.row_global_scale,
        out,
        n,
        k,
        k_pad,
        layout.words.stride(0),
        layout.scale_words.stride(0),
        out.stride(0),
        BLOCK_N=_BLOCK_N,
        HALVES=_HALVES,
        num_warps=4,
    )
    return out
