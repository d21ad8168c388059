"""The NVFP4 weight layout of the Triton kernels (`KernelLayout`, built once at load, and its
packer), with the in-register decode the kernels share (`decode_group`) and their dot-dtype
choice. The kernels: `kernels.nvfp4_w4a16` (the matmul), `kernels.nvfp4_dequant` (to bf16 for
cuBLAS at prefill sizes), `kernels.fused_moe_triton` (experts).

NOTE: `triton.jit` reads TRITON_INTERPRET when it decorates, i.e. when this module is imported,
and triton's own helpers (`tl.zeros`, `tl.cdiv`, `tl.sum`, ...) are jit functions decorated at
`import triton`. So the kernels use core builtins only: then setting the variable and
(re)importing the kernel modules is enough to interpret it, whenever triton itself was imported."""

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
    # [ceil(N / 16)] int32, zero between launches: the split-K arrival counters of
    # `kernels.nvfp4_w4a16.w4a16_matmul`, one per output tile. Each layout has its own, so two
    # layers never share one; NOTE: one layout must not run on two streams at once.
    tile_locks: Tensor | None = None

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
    locks = torch.zeros(triton.cdiv(n, 16), dtype=torch.int32, device=packed.device)
    return KernelLayout(words, scales.view(torch.int32), row_global_scale.contiguous(), k, locks)


def unpack_kernel_layout(layout: KernelLayout) -> tuple[Tensor, Tensor]:
    """Inverse of `pack_kernel_layout`: (codes [N, K] uint8, block_scale [N, K/16] e4m3)."""
    n, k = layout.n, layout.k
    shifts = torch.tensor(_PACK_SHIFTS, dtype=torch.int64, device=layout.words.device).reshape(1, 1, 1, 4, 1, 2)
    words = layout.words.to(torch.int64) & 0xFFFFFFFF
    nibbles = (words.reshape(n, -1, 2, 1, 8, 1) >> shifts) & 0xF
    codes = nibbles.reshape(n, -1)[:, :k].to(torch.uint8)
    block_scale = layout.scale_words.view(torch.uint8)[:, : k // 16].view(torch.float8_e4m3fn)
    return codes, block_scale


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


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
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
