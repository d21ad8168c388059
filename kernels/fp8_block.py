"""Block-wise FP8 weights (the layout of Qwen's and DeepSeek's FP8 releases): float8_e4m3fn codes
with one float32 scale per [block_n x block_k] block (`weight_scale_inv`: the factor the codes are
multiplied by, despite its name), their exact dequantization, the W8A8 matmul reference (activations
quantized per token and group of block_k, dynamically). The dispatch and `Fp8Linear`, the module
layers hold, are in kernels/fp8_dispatch.py.

The checkpoint's scale grid is [ceil(N / block_n), ceil(K / block_k)]. Fusing shards whose row
counts are not whole blocks (q/k/v of a tiny model) expands the grid to one scale row per output
row (block_n = 1): the same values, so the same products."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
# Smallest activation amax a group is scaled by: an all-zero group then quantizes to zeros, not NaN.
ACT_EPS = 1e-10


@dataclass(frozen=True)
class Fp8BlockWeight:
    """One linear's weight [N, K] = codes * scale of its block, in float32."""

    codes: Tensor  # [N, K] float8_e4m3fn
    scale: Tensor  # [ceil(N / block_n), ceil(K / block_k)] float32 (the checkpoint's weight_scale_inv)
    block_n: int  # output rows per scale row (128 in Qwen's releases; 1 after an unaligned fuse)
    block_k: int  # input columns per scale column: also the activation group

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        assert self.codes.dtype == FP8_DTYPE, f"codes must be float8_e4m3fn, got {self.codes.dtype}"
        expected = (-(-n // self.block_n), -(-k // self.block_k))
        assert tuple(self.scale.shape) == expected, f"scale grid {tuple(self.scale.shape)}, expected {expected}"

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device: torch.device) -> Fp8BlockWeight:
        return Fp8BlockWeight(self.codes.to(device), self.scale.to(device), self.block_n, self.block_k)

    def row_scales(self) -> Tensor:
        """[N, ceil(K / block_k)] float32: each output row's scales (the grid with block_n = 1)."""
        return self.scale.repeat_interleave(self.block_n, dim=0)[: self.shape[0]]


def check_block_scale(codes_shape: tuple[int, ...], scale_shape: tuple[int, ...], block: tuple[int, int]) -> str | None:
    """None when `scale_shape` is the block grid of `codes_shape` ([..., N, K]); else what is wrong."""
    *lead, n, k = codes_shape
    expected = (*lead, -(-n // block[0]), -(-k // block[1]))
    if tuple(scale_shape) != expected:
        return f"scale of shape {list(scale_shape)}, expected {list(expected)} ({block[0]}x{block[1]} blocks)"
    return None


def expand_block_scale(scale: Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> Tensor:
    """[..., ceil(N / bn), ceil(K / bk)] -> [..., N, K]: every element's block scale."""
    n, k = shape[-2:]
    return scale.repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]


def dequantize_block_fp8(codes: Tensor, scale: Tensor, block: tuple[int, int]) -> Tensor:
    """[..., N, K] float8_e4m3fn codes and their block grid -> float32, exactly codes * scale as
    float32 products (the same products transformers' FP8 dequantization computes)."""
    return codes.float() * expand_block_scale(scale.float(), tuple(codes.shape), block)


def quantize_block_fp8(weight: Tensor, block: tuple[int, int] = (128, 128)) -> tuple[Tensor, Tensor]:
    """[..., N, K] float -> (codes float8_e4m3fn, scale float32 grid): each block scaled by its
    amax / 448, the recipe of DeepSeek-V3's and Qwen's FP8 releases. An all-zero block gets scale 1."""
    w = weight.float()
    n, k = w.shape[-2:]
    bn, bk = block
    pad = (0, -k % bk, 0, -n % bn)
    blocks = F.pad(w, pad).unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # [..., N/bn, bn, K/bk, bk]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., N/bn, K/bk]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (w / expand_block_scale(scale, tuple(w.shape), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def quantize_activation_groups(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (codes [M, K] float8_e4m3fn, scales [M, ceil(K / group)] float32): dynamic
    per-token, per-group (1 x group) scales amax / 448, as vLLM's and DeepSeek's act_quant compute
    them (zero groups scaled by ACT_EPS / 448)."""
    m, k = x.shape
    xf = F.pad(x.float(), (0, -k % group)).view(m, -1, group)  # [M, G, group]
    scale = xf.abs().amax(dim=-1).clamp_min(ACT_EPS) / FP8_MAX  # [M, G]
    codes = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes.view(m, -1)[:, :k], scale


def w8a8_block_matmul_ref(x: Tensor, w: Fp8BlockWeight, bias: Tensor | None = None) -> Tensor:
    """x [M, K] -> [M, N] in x.dtype: activations quantized per (token, group of block_k), each
    group's exact fp8 x fp8 products summed in float32 and scaled by its activation scale times the
    weight block's scale. Every kernel is checked against this."""
    n, k = w.shape
    assert x.shape[-1] == k, f"x has K={x.shape[-1]}, the weight K={k}"
    codes, x_scale = quantize_activation_groups(x, w.block_k)  # [M, K], [M, G]
    w_scale = w.row_scales()  # [N, G]
    out = torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device)
    for g in range(x_scale.shape[1]):
        cols = slice(g * w.block_k, min((g + 1) * w.block_k, k))
        part = codes[:, cols].float() @ w.codes[:, cols].float().T  # [M, N] exact products, f32 sums
        out += part * x_scale[:, g, None] * w_scale[None, :, g]
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def fuse_fp8(shards: list[Fp8BlockWeight]) -> Fp8BlockWeight:
    """Shards of one fused linear (q/k/v, gate/up) stacked on N. Kept on the block grid when every
    shard's rows are whole blocks, else expanded to one scale row per output row."""
    first = shards[0]
    assert all(s.block_k == first.block_k and s.shape[1] == first.shape[1] for s in shards), "shards disagree on K"
    codes = torch.cat([s.codes for s in shards])
    if all(s.block_n == first.block_n and s.shape[0] % s.block_n == 0 for s in shards):
        return Fp8BlockWeight(codes, torch.cat([s.scale for s in shards]), first.block_n, first.block_k)
    return Fp8BlockWeight(codes, torch.cat([s.row_scales() for s in shards]), 1, first.block_k)


def fp8_device_supported(device: torch.device) -> bool:
    """FP8 tensor-core dots: CUDA SM89+ (Ada, Hopper, Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
