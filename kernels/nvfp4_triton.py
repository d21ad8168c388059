"""The Triton W4A16 NVFP4 matmul: y[M, N] = x[M, K] @ W[N, K]^T with W's E2M1 codes and E4M3
block scales dequantized in registers, 16-bit tensor-core dots, fp32 accumulate, the per-row
global scale in the epilogue, and split-K for decode sizes. Also the kernel's weight layout
(`KernelLayout`, built once at load). Reference: `kernels.nvfp4_matmul.nvfp4_linear_ref`.

NOTE: `triton.jit` reads TRITON_INTERPRET when it decorates, i.e. when this module is imported,
and triton's own helpers (`tl.zeros`, `tl.cdiv`, `tl.sum`, ...) are jit functions decorated at
`import triton`. So the kernel uses core builtins only: then setting the variable and
(re)importing this module is enough to interpret it, whenever triton itself was imported."""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.nvfp4 import unpack_e2m1

CHUNK_K = 128  # K per kernel step: 8 scale groups of 16, stored as 16 int32 words per row
_PACK_CHUNK_ELEMENTS = 1 << 22  # weights re-laid at once by pack_kernel_layout
# Bit offset of the nibble for (q, h) in its word, q-major; see the layout note below.
_PACK_SHIFTS = tuple(16 * h + 12 - 4 * q for q in range(4) for h in range(2))

# Kernel weight layout, per row and per 128-wide K chunk (16 int32 words):
#   element k = 16 r + j of the chunk (r = scale group 0-7, j = 0-15) lives in word
#   8 (r // 4) + j // 2, in 16-bit lane j % 2, at lane bits [15 - 4q, 12 - 4q], q = r % 4.
# So `(word << 4q) & 0x80008000 | ((word << 4q) >> 3) & 0x0E000E00` is two fp16s worth
# e2m1 * 2**-14 (exact, subnormal included) for the k-adjacent pair (j, j + 1) of group r:
# one shift and two masks per two weights, the pair already in the register the MMA operand
# wants, and each decoded [rows, 16] slice is exactly one scale group (no broadcasts).


@dataclass(frozen=True)
class KernelLayout:
    """An NVFP4 weight re-laid for `w4a16_matmul` (the only resident copy on the GPU)."""

    words: Tensor  # [N, K_pad / 8] int32, K_pad = K rounded up to CHUNK_K; layout above
    scale_words: Tensor  # [N, K_pad / 64] int32: the e4m3 block scales, 4 per word, zero-padded
    row_global_scale: Tensor  # [N] float32: S of each output row (its shard's)
    k: int  # logical K

    @property
    def n(self) -> int:
        return self.words.shape[0]

    @property
    def nbytes(self) -> int:
        return self.words.nbytes + self.scale_words.nbytes + self.row_global_scale.nbytes


def pack_kernel_layout(packed: Tensor, block_scale: Tensor, row_global_scale: Tensor) -> KernelLayout:
    """packed [N, K/2] uint8 (the canonical nibble order), block_scale [N, K/16] e4m3,
    row_global_scale [N] fp32 -> KernelLayout. Works in row chunks so the int64 temporaries
    stay ~32 MiB even for an lm_head."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    k_pad = triton.cdiv(k, CHUNK_K) * CHUNK_K
    words = torch.empty(n, k_pad // 8, dtype=torch.int32, device=packed.device)
    # [rows, chunk, r // 4, q, j // 2, j % 2] -> shift each nibble into place; bits are disjoint.
    shifts = torch.tensor(_PACK_SHIFTS, dtype=torch.int64, device=packed.device).reshape(1, 1, 1, 4, 1, 2)
    rows_per_chunk = max(1, _PACK_CHUNK_ELEMENTS // k_pad)
    for start in range(0, n, rows_per_chunk):
        stop = min(start + rows_per_chunk, n)
        codes = torch.zeros(stop - start, k_pad, dtype=torch.int64, device=packed.device)
        codes[:, :k] = unpack_e2m1(packed[start:stop])
        chunk = (codes.reshape(stop - start, k_pad // CHUNK_K, 2, 4, 8, 2) << shifts).sum(dim=(3, 5))
        chunk = chunk.reshape(stop - start, k_pad // 8)
        words[start:stop] = torch.where(chunk >= 2**31, chunk - 2**32, chunk).to(torch.int32)  # uint32 bits
    scales = torch.zeros(n, k_pad // 16, dtype=torch.uint8, device=packed.device)
    scales[:, : k // 16] = block_scale.view(torch.uint8)
    return KernelLayout(words, scales.view(torch.int32), row_global_scale.contiguous(), k)


def unpack_kernel_layout(layout: KernelLayout) -> tuple[Tensor, Tensor]:
    """Inverse of `pack_kernel_layout`: (codes [N, K] uint8, block_scale [N, K/16] e4m3)."""
    n, k = layout.n, layout.k
    shifts = torch.tensor(_PACK_SHIFTS, dtype=torch.int64, device=layout.words.device).reshape(1, 1, 1, 4, 1, 2)
    words = layout.words.to(torch.int64) & 0xFFFFFFFF
    nibbles = (words.reshape(n, -1, 2, 1, 8, 1) >> shifts) & 0xF
    codes = nibbles.reshape(n, -1)[:, :k].to(torch.uint8)
    block_scale = layout.scale_words.view(torch.uint8)[:, : k // 16].view(torch.float8_e4m3fn)
    return codes, block_scale


@dataclass(frozen=True)
class W4A16Config:
    """Tile and launch parameters. W's rows (N) are the dot's left side ("swap AB"), so a decode
    batch of M <= 16 tokens fills a 16-wide tile rather than padding a 64-row MMA."""

    block_m: int  # tokens per tile, a power of two >= 16
    block_n: int  # weight rows per tile, a power of two >= 16
    split_k: int = 1  # > 1: fp32 partial sums per K slice, reduced after the kernel
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            size = getattr(self, name)
            assert size >= 16 and size & (size - 1) == 0, f"{name}={size} must be a power of two >= 16"
        assert self.split_k >= 1, f"split_k={self.split_k}"


def choose_config(m: int, n: int, k: int, num_sms: int) -> W4A16Config:
    """Tiles by batch size; split K until there are about two CTAs per SM, since decode sizes are
    memory-bound and N / block_n alone leaves most SMs idle at N = 4096. The split is capped so
    the fp32 partial sums (written and read back: 8 bytes per output per slice) move fewer bytes
    than the weights (9/16 byte per element), which stops it at prefill sizes."""
    if m <= 16:
        block_m, block_n, warps, stages = 16, 128, 4, 4
    elif m <= 64:
        block_m, block_n, warps, stages = triton.next_power_of_2(m), 128, 4, 4
    else:
        block_m, block_n, warps, stages = 128, 128, 8, 3
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    chunks = triton.cdiv(k, CHUNK_K)
    max_split = min(16, max(1, (9 * k) // (16 * 8 * m)))
    split_k = 1
    # Keep at least four K steps per slice so the software pipeline has something to overlap.
    while tiles * split_k < 2 * num_sms and chunks >= 2 * split_k * 4 and 2 * split_k <= max_split:
        split_k *= 2
    return W4A16Config(block_m, block_n, split_k, warps, stages)


@triton.jit
def decode_group(words, scales, q: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """[BLOCK_N, 16] weights of scale group 4 * half + q, times 2**-14, from [BLOCK_N, 8] packed
    words and [BLOCK_N] int32 of four e4m3 block scales (byte q for that group)."""
    shifted = words << (4 * q)
    pair = (shifted & 0x80008000) | ((shifted >> 3) & 0x0E000E00)
    bits = tl.join((pair & 0xFFFF).to(tl.uint16), (pair >> 16).to(tl.uint16)).reshape(BLOCK_N, 16)
    # e4m3 bits << 7 are fp16 bits worth sf * 2**-8; sf itself is exact in fp16.
    scale_bits = ((scales >> (8 * q)) & 0xFF).to(tl.uint16) << 7
    scale = (scale_bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0).to(tl.float16)
    # e2m1 * 2**-14 * sf: a multiple of 2**-24 with <= 6 significant bits, <= 0.17,
    # so exact in fp16 and in bf16 (the 2**14 goes back in the epilogue).
    return (bits.to(tl.float16, bitcast=True) * scale[:, None]).to(DOT_DTYPE)


@triton.jit
def _w4a16_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, bias_ptr, out_ptr,
    M, N, K, k_pad, k_per_split,
    stride_xm, stride_xk, stride_wn, stride_sn, stride_os, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_word = tl.arange(0, 8)
    offs_j = tl.arange(0, 16)
    n_ok = offs_n < N
    m_ok = offs_m < M
    acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
    # A fixed trip count (not min(slice end, k_pad)): the last slice may overrun k_pad, and those
    # steps load nothing. EVEN_K: K is whole chunks and every slice is whole, so no K masks.
    for step in range(0, k_per_split, 128):
        k0 = pid_k * k_per_split + step
        if EVEN_K:
            row_ok = n_ok
        else:
            row_ok = offs_n < tl.where(k0 < k_pad, N, 0)  # no rows past the end of K
        for half in tl.static_range(2):  # scale groups 0-3, then 4-7
            # [BLOCK_N, 8] words: two k-adjacent elements of four groups each.
            words = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 // 8 + 8 * half + offs_word)[None, :],
                            mask=row_ok[:, None], other=0).to(tl.uint32, bitcast=True)
            # [BLOCK_N] int32: four e4m3 block scales, byte q for group 4 * half + q.
            scales = tl.load(s_ptr + offs_n * stride_sn + k0 // 64 + half, mask=row_ok, other=0)
            for q in tl.static_range(4):
                w = decode_group(words, scales, q, BLOCK_N, DOT_DTYPE)
                offs_k = k0 + 16 * (4 * half + q) + offs_j
                if EVEN_K:
                    x_ok = m_ok[None, :]
                else:
                    x_ok = m_ok[None, :] & (offs_k < K)[:, None]
                # [16, BLOCK_M] activations, transposed so W is the left operand.
                x_t = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None] * stride_xk,
                              mask=x_ok, other=0.0)
                acc = tl.dot(w, x_t.to(DOT_DTYPE), acc)

    acc = acc * 16384.0 / tl.load(g_ptr + offs_n, mask=n_ok, other=1.0)[:, None]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        acc += bias[:, None] * (pid_k == 0).to(tl.float32)  # added once, by the first K slice
    out = out_ptr + pid_k * stride_os + offs_m[None, :] * stride_om + offs_n[:, None] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def _tl_dtype(dtype: torch.dtype) -> tl.dtype:
    if dtype == torch.bfloat16:
        return tl.bfloat16
    if dtype == torch.float16:
        return tl.float16
    raise ValueError(f"dot dtype must be bfloat16 or float16, got {dtype}")


def default_dot_dtype(x: Tensor) -> torch.dtype:
    """bf16 on the GPU (fp16 for fp16 activations, keeping their mantissa); fp16 on CPU, which
    only runs under TRITON_INTERPRET=1, where bf16 dots return garbage."""
    if x.dtype == torch.float16 or x.device.type == "cpu":
        return torch.float16
    return torch.bfloat16


def w4a16_matmul(
    x: Tensor,
    weight: KernelLayout,
    bias: Tensor | None = None,
    *,
    dot_dtype: torch.dtype | None = None,
    config: W4A16Config | None = None,
) -> Tensor:
    """x [M, K] bf16/fp16/fp32, bias [N] | None -> [M, N] in x.dtype. Activations are rounded to
    the dot dtype in registers (fp32 ones lose precision there); accumulation is fp32."""
    m, k = x.shape
    n = weight.n
    assert k == weight.k, f"x has K={k}, weight has K={weight.k}"
    if m == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    assert weight.words.stride(1) == 1 and weight.scale_words.stride(1) == 1
    if config is None:
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        config = choose_config(m, n, k, num_sms)
    chunks = triton.cdiv(k, CHUNK_K)
    k_per_split = triton.cdiv(chunks, config.split_k) * CHUNK_K
    split_k = triton.cdiv(chunks * CHUNK_K, k_per_split)  # no empty slices
    if split_k == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    else:
        out = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)  # [S, M, N]
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), split_k)
    _w4a16_kernel[grid](
        x, weight.words, weight.scale_words, weight.row_global_scale,
        bias if bias is not None else weight.row_global_scale, out,
        m, n, k, chunks * CHUNK_K, k_per_split,
        x.stride(0), x.stride(1), weight.words.stride(0), weight.scale_words.stride(0),
        out.stride(0) if split_k > 1 else 0, out.stride(-2), out.stride(-1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        EVEN_K=k % CHUNK_K == 0 and chunks % split_k == 0, HAS_BIAS=bias is not None,
        DOT_DTYPE=_tl_dtype(dot_dtype or default_dot_dtype(x)),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split_k == 1:
        return out
    # A fixed-order sum keeps results bit-identical run to run (atomics would not).
    return out.sum(dim=0).to(x.dtype)
