"""Fused mixture-of-experts in torch: the float32 router (softmax, top-k, renormalize), the
per-expert NVFP4 weight stack, the block-aligned token sort the Triton kernel walks
(`moe_align_block_size`), and the grouped reference every kernel is checked against. The dispatch
between this reference and kernels/fused_moe_triton.py is kernels/moe_dispatch.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.nvfp4 import NVFP4Weight, dequantize_nvfp4, fuse_nvfp4


def route(x: Tensor, gate_weight: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """x [T, H], gate_weight [E, H] -> (topk_weights [T, k] float32, topk_ids [T, k] int64).

    The router runs in float32 whatever the model dtype: a bf16 softmax over 128 experts would
    re-rank near-ties. Same order of operations as transformers' Qwen3MoeTopKRouter."""
    return select_experts(F.linear(x.float(), gate_weight.float()), top_k, renormalize)


def select_experts(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """router_logits [T, E] float32 -> (topk_weights [T, k] float32, topk_ids [T, k] int64):
    softmax over the experts, top-k, renormalized to sum to 1 when asked."""
    probs = torch.softmax(router_logits, dim=-1)  # [T, E] float32
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


@dataclass(frozen=True)
class NVFP4ExpertWeights:
    """One projection of every expert in NVFP4, stacked: expert e's weight [N, K] is
    e2m1(code) * block_scale / global_scale[e, shard]. Each expert keeps its own global scale per
    shard (gate and up apart), so nothing is re-rounded when experts are stacked or fused."""

    packed: Tensor  # [E, N, K/2] uint8
    block_scale: Tensor  # [E, N, K/16] float8_e4m3fn
    global_scale: Tensor  # [E, num_shards] float32, encode direction S
    shard_sizes: tuple[int, ...]  # output rows of each shard; sums to N

    def __post_init__(self) -> None:
        e, n, _ = self.packed.shape
        assert self.global_scale.shape == (e, len(self.shard_sizes)), (
            f"global_scale {tuple(self.global_scale.shape)} for {e} experts x {len(self.shard_sizes)} shards"
        )
        assert sum(self.shard_sizes) == n, f"shard sizes {self.shard_sizes} do not sum to N={n}"

    @property
    def num_experts(self) -> int:
        return self.packed.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (N, K) of one expert's weight."""
        return self.packed.shape[1], 2 * self.packed.shape[2]

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.block_scale.nbytes + self.global_scale.nbytes

    def expert(self, e: int) -> NVFP4Weight:
        one = len(self.shard_sizes) == 1
        return NVFP4Weight(
            self.packed[e],
            self.block_scale[e],
            self.global_scale[e, 0] if one else self.global_scale[e],
            None if one else self.shard_sizes,
        )

    def row_global_scale(self) -> Tensor:
        """[E, N] float32: each output row's global scale."""
        sizes = torch.tensor(self.shard_sizes, device=self.global_scale.device)
        return self.global_scale.repeat_interleave(sizes, dim=1, output_size=self.shape[0])

    @staticmethod
    def stack(per_expert: list[list[NVFP4Weight]]) -> NVFP4ExpertWeights:
        """per_expert[e] = that expert's shards in order (gate, up) or (down,)."""
        fused = [shards[0] if len(shards) == 1 else fuse_nvfp4(shards) for shards in per_expert]
        sizes = fused[0].shard_sizes or (fused[0].shape[0],)
        assert all((w.shard_sizes or (w.shape[0],)) == sizes for w in fused), "experts disagree on shape"
        return NVFP4ExpertWeights(
            torch.stack([w.packed for w in fused]),
            torch.stack([w.block_scale for w in fused]),
            torch.stack([w.global_scale.reshape(-1) for w in fused]),
            sizes,
        )


def expert_matrix(w: Tensor | NVFP4ExpertWeights, e: int, dtype: torch.dtype) -> Tensor:
    """Expert e's weight [N, K] in `dtype` (a dequantized temporary for NVFP4)."""
    if isinstance(w, NVFP4ExpertWeights):
        return dequantize_nvfp4(w.expert(e), dtype)
    return w[e]


def fused_experts_ref(
    x: Tensor, w13: Tensor | NVFP4ExpertWeights, w2: Tensor | NVFP4ExpertWeights, topk_weights: Tensor, topk_ids: Tensor
) -> Tensor:
    """sum_j topk_weights[t, j] * expert_{ids[t, j]}(x[t]) with SwiGLU experts, for x [T, H] ->
    [T, H] in x.dtype. w13: gate rows then up rows [E, 2I, H]; w2: [E, H, I].

    Tokens are sorted by expert once; then one matmul per projection per expert that got tokens
    (no loop over tokens). The one host read is the per-expert counts."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat_ids, stable=True)  # [T*k] slots grouped by expert
    token_of = order // top_k  # [T*k] the token each sorted slot reads
    counts = torch.bincount(flat_ids, minlength=_num_experts(w13)).tolist()
    x_sorted = x[token_of]  # [T*k, H]
    out_sorted = torch.empty_like(x_sorted)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        gate, up = F.linear(x_sorted[rows], expert_matrix(w13, e, x.dtype)).chunk(2, dim=-1)
        out_sorted[rows] = F.linear(F.silu(gate) * up, expert_matrix(w2, e, x.dtype))
        start += count
    weights = topk_weights.reshape(-1)[order].to(x.dtype)  # [T*k]
    out = torch.zeros_like(x)
    return out.index_add_(0, token_of, out_sorted * weights[:, None])


def _num_experts(w: Tensor | NVFP4ExpertWeights) -> int:
    if isinstance(w, Tensor):
        return w.shape[0]
    return w.num_experts


def moe_align_block_size(topk_ids: Tensor, block_m: int, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Sort the T*k (token, slot) pairs by expert, each expert's run padded to a multiple of
    `block_m`, so every block of `block_m` sorted rows belongs to one expert. No host sync: the
    outputs have their worst-case sizes.

    Returns sorted_ids [P] int32 (flat slot t*k+j; padding = T*k), block_expert [P / block_m]
    int32 (-1 for blocks past the end) and num_padded [1] int32, P = the worst case rounded to
    block_m."""
    flat = topk_ids.reshape(-1)
    numel = flat.numel()
    max_padded = -(-(numel + num_experts * (block_m - 1)) // block_m) * block_m
    # NOTE: not torch.bincount, which reads the max id back to the host on CUDA (no graph capture).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat)
    )  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # [E] end of each expert's padded run
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(numel, device=flat.device) - (counts.cumsum(0) - counts)[sorted_experts]
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=flat.device)
    sorted_ids[(ends - padded)[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=flat.device)
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    block_expert = torch.where(block_starts < ends[-1], block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert, ends[-1:].to(torch.int32)
