"""The weight-only int4 linear for a few rows as a single CPU op (`torch.ops.fp4serve_cpu.int4_gemv`
of `cpu_int4.cpp`, compiled and loaded by kernels/cpu_ops.py), its weight layout, and the
pure-torch reference the tests hold it to. It sums in float32 and rounds once to bf16."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

GROUP = 32  # columns per scale and zero
PAIR = 64  # K is padded to whole pairs of groups (the op reads superblocks of 8 groups, then pairs)
SUPER_COLS = 8 * GROUP  # columns per superblock


def int4_gemv_native() -> bool:
    """Whether the loaded op has its AVX512-BF16 loop (else it runs a plain float loop: correct,
    slower than torch's own int4 kernel)."""
    return bool(torch.ops.fp4serve_cpu.int4_gemv_native.default())


def _superblock_index() -> tuple[Tensor, Tensor]:
    """(group, column) [2, 32, 4] of nibble m of word e of half q of a superblock of 8 groups:
    group (e / 2) % 8, column 16 ((e / 2) / 8) + 2 (4q + m) + e % 2 (kernels/cpu_int4.cpp's header)."""
    q = torch.arange(2)[:, None, None]
    e = torch.arange(32)[None, :, None]
    m = torch.arange(4)[None, None, :]
    lane = e // 2
    return (lane % 8).expand(2, 32, 4), (16 * (lane // 8) + 2 * (4 * q + m) + e % 2)


def pack_int4_codes(codes: Tensor, scales_and_zeros: Tensor) -> tuple[Tensor, Tensor]:
    """codes [N, K] uint8 in 0..15 and scales_and_zeros [K / 32, N, 2] bf16 (quantize_int4's) ->
    the op's layout (kernels/cpu_int4.cpp's header): codes [N, Kp / 2] uint8, Kp = K rounded up
    to 64, in superblocks of 8 groups (64 16-bit words whose 32-bit lanes each hold one group's
    codes, so the op scales a superblock once per lane) and pairs of groups after them (16 words,
    word j = columns j and j + 16 of both); scales_zeros [N, Kp / 32, 2] bf16, a padding group
    with scale and zero 0."""
    n, k = codes.shape
    assert k % GROUP == 0 and scales_and_zeros.shape == (k // GROUP, n, 2)
    pad = -k % PAIR
    q = F.pad(codes, (0, pad)).to(torch.int32)  # [N, Kp]
    kp = q.shape[1]
    main = kp // SUPER_COLS * SUPER_COLS
    group, column = _superblock_index()
    nib = q[:, :main].reshape(n, -1, 8, GROUP)[:, :, group, column]  # [N, supers, half, word, nibble]
    words = [nib[..., 0] | (nib[..., 1] << 4) | (nib[..., 2] << 8) | (nib[..., 3] << 12)]
    if main < kp:
        last = q[:, main:].reshape(n, -1, 2, 2, 16)  # [N, pairs, group, half, column]
        words.append(last[:, :, 0, 0] | (last[:, :, 0, 1] << 4) | (last[:, :, 1, 0] << 8) | (last[:, :, 1, 1] << 12))
    flat = torch.cat([w.reshape(n, -1) for w in words], dim=1)  # [N, Kp / 4] 16-bit words
    packed = torch.stack([flat & 0xFF, flat >> 8], dim=-1).reshape(n, -1).to(torch.uint8)  # little-endian
    sz = F.pad(scales_and_zeros.transpose(0, 1), (0, 0, 0, pad // GROUP)).contiguous()  # [N, Kp / 32, 2]
    return packed.contiguous(), sz


def unpack_int4_codes(packed: Tensor) -> Tensor:
    """`pack_int4_codes`'s codes back to [N, Kp] uint8 in 0..15."""
    n, half = packed.shape
    b = packed.to(torch.int32)
    words = b[:, 0::2] | (b[:, 1::2] << 8)  # [N, Kp / 4]
    nibbles = torch.stack([(words >> s) & 0xF for s in (0, 4, 8, 12)], dim=-1)  # [N, Kp / 4, 4]
    kp = half * 2
    main = kp // SUPER_COLS * SUPER_COLS
    group, column = _superblock_index()
    supers = torch.empty(n, main // SUPER_COLS, 8, GROUP, dtype=torch.int32)
    supers[:, :, group, column] = nibbles[:, : main // 4].reshape(n, -1, 2, 32, 4)
    out = [supers.reshape(n, -1)]
    if main < kp:
        last = nibbles[:, main // 4 :].reshape(n, -1, 16, 2, 2)  # [N, pairs, column j, group, half]
        out.append(last.permute(0, 1, 3, 4, 2).reshape(n, -1))
    return torch.cat(out, dim=1).to(torch.uint8)


def int4_gemv(x: Tensor, codes: Tensor, scales_zeros: Tensor) -> Tensor:
    """x [T, K] bf16 (K at most the codes' Kp, within one pair of groups of it) @ W^T -> [T, N] bf16,
    W = (code - 8) * scale + zero per group."""
    return torch.ops.fp4serve_cpu.int4_gemv.default(x, codes, scales_zeros)


def int4_gemv_ref(x: Tensor, codes: Tensor, scales_zeros: Tensor) -> Tensor:
    """What `int4_gemv` computes, up to float32 summation order."""
    q = unpack_int4_codes(codes).float()  # [N, Kp]
    n, kp = q.shape
    scale, zero = scales_zeros[..., 0].float(), scales_zeros[..., 1].float()  # [N, Kp / 32]
    w = ((q.reshape(n, -1, GROUP) - 8) * scale[..., None] + zero[..., None]).reshape(n, kp)
    return (F.pad(x.float(), (0, kp - x.shape[1])) @ w.t()).to(x.dtype)
