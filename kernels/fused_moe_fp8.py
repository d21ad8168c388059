"""Fused mixture-of-experts with block-FP8 experts (W8A8): every expert's weights stacked as
float8_e4m3fn codes with their block-scale grids, and the grouped torch reference (tokens sorted by
expert, `w8a8_block_matmul_ref` per expert that got tokens). The Triton grouped GEMM is
kernels/fused_moe_fp8_triton.py; the dispatch and `Fp8Experts`, the module a `SparseMoeBlock`
holds, are in kernels/fp8_dispatch.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.fp8_block import FP8_DTYPE, Fp8BlockWeight, fuse_fp8, w8a8_block_matmul_ref


@dataclass(frozen=True)
class Fp8ExpertWeights:
    """One projection of every expert: expert e's weight [N, K] = codes[e] * its block scales."""

    codes: Tensor  # [E, N, K] float8_e4m3fn
    scale: Tensor  # [E, ceil(N / block_n), ceil(K / block_k)] float32
    block_n: int
    block_k: int

    def __post_init__(self) -> None:
        e, n, k = self.codes.shape
        assert self.codes.dtype == FP8_DTYPE, f"codes must be float8_e4m3fn, got {self.codes.dtype}"
        expected = (e, -(-n // self.block_n), -(-k // self.block_k))
        assert tuple(self.scale.shape) == expected, f"scale grid {tuple(self.scale.shape)}, expected {expected}"

    @property
    def num_experts(self) -> int:
        return self.codes.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[1], self.codes.shape[2]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def expert(self, e: int) -> Fp8BlockWeight:
        return Fp8BlockWeight(self.codes[e], self.scale[e], self.block_n, self.block_k)

    @staticmethod
    def stack(per_expert: list[list[Fp8BlockWeight]]) -> Fp8ExpertWeights:
        """per_expert[e] = that expert's shards in order (gate, up) or (down,)."""
        fused = [shards[0] if len(shards) == 1 else fuse_fp8(shards) for shards in per_expert]
        block_n = min(w.block_n for w in fused)
        if any(w.block_n != block_n for w in fused):  # an unaligned fuse in some experts only
            fused = [Fp8BlockWeight(w.codes, w.row_scales(), 1, w.block_k) for w in fused]
        return Fp8ExpertWeights(
            torch.stack([w.codes for w in fused]),
            torch.stack([w.scale for w in fused]),
            fused[0].block_n,
            fused[0].block_k,
        )


def fused_experts_fp8_ref(
    x: Tensor, w13: Fp8ExpertWeights, w2: Fp8ExpertWeights, topk_weights: Tensor, topk_ids: Tensor
) -> Tensor:
    """sum_j topk_weights[t, j] * expert_{ids[t, j]}(x[t]), SwiGLU experts, W8A8: x [T, H] -> [T, H]
    in x.dtype. Tokens sorted by expert once, then one W8A8 matmul per projection per expert that
    got tokens; the gate/up output is rounded to x.dtype before SwiGLU, as the kernel path does."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # [T*k] slots grouped by expert
    token_of = order // top_k
    counts = torch.bincount(flat_ids, minlength=w13.num_experts).tolist()
    x_sorted = x[token_of]  # [T*k, H]
    out_sorted = torch.empty_like(x_sorted)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        gate, up = w8a8_block_matmul_ref(x_sorted[rows], w13.expert(e)).chunk(2, dim=-1)
        out_sorted[rows] = w8a8_block_matmul_ref(F.silu(gate) * up, w2.expert(e))
        start += count
    weights = topk_weights.reshape(-1)[order].to(x.dtype)
    out = torch.zeros_like(x)
    return out.index_add_(0, token_of, out_sorted * weights[:, None])
