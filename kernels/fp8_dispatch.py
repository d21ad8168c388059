"""The block-FP8 dispatch and the modules layers hold: the Triton kernels (kernels/fp8_triton.py,
kernels/fused_moe_fp8_triton.py) on CUDA SM89+, the torch references (kernels/fp8_block.py,
kernels/fused_moe_fp8.py) elsewhere. Its own module so that each kernel and the reference it builds
on do not import each other."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kernels.fp8_block import Fp8BlockWeight, fp8_device_supported, w8a8_block_matmul_ref
from kernels.fused_moe_fp8 import Fp8ExpertWeights, fused_experts_fp8_ref


def fp8_block_linear(x: Tensor, w: Fp8BlockWeight, bias: Tensor | None = None) -> Tensor:
    """x [M, K] -> [M, N] in x.dtype on x's device: the Triton kernel on CUDA SM89+, else the reference."""
    if fp8_device_supported(x.device):
        from kernels.fp8_triton import w8a8_block_matmul

        return w8a8_block_matmul(x.contiguous(), w, bias)
    return w8a8_block_matmul_ref(x, w, bias)


class Fp8Linear(torch.nn.Module):
    """A linear layer with block-FP8 weights, W8A8: y = x @ W^T + b for x [..., K].

    NOTE: like NVFP4Linear, the weight is no registered buffer, so `.to(dtype)` cannot cast the
    fp8 codes; build it on its final device."""

    def __init__(self, weight: Fp8BlockWeight, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight_fp8 = weight
        self.bias: Tensor | None
        self.register_buffer("bias", bias)  # [N] or None, in the model's dtype

    @property
    def weight_nbytes(self) -> int:
        return self.weight_fp8.nbytes

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        y = fp8_block_linear(x.reshape(-1, self.in_features), self.weight_fp8, self.bias)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        w = self.weight_fp8
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"fp8 e4m3 {w.block_n}x{w.block_k} blocks, W8A8"
        )


def fused_experts_fp8(
    x: Tensor, w13: Fp8ExpertWeights, w2: Fp8ExpertWeights, topk_weights: Tensor, topk_ids: Tensor
) -> Tensor:
    """The FP8 fused MoE on x's device: the Triton kernel on CUDA SM89+, else the reference."""
    if fp8_device_supported(x.device):
        from kernels.fused_moe_fp8_triton import fused_experts_fp8_triton

        return fused_experts_fp8_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_experts_fp8_ref(x, w13, w2, topk_weights, topk_ids)


class Fp8Experts(nn.Module):
    """Every expert's weights in block FP8, W8A8. NOTE: the weights are no registered buffers (so
    `.to(dtype)` cannot cast the codes): build it on its final device."""

    def __init__(self, w13: Fp8ExpertWeights, w2: Fp8ExpertWeights) -> None:
        super().__init__()
        self.num_experts = w13.num_experts
        self.intermediate_size = w2.shape[1]
        self.w13 = w13
        self.w2 = w2

    @property
    def weight_nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        return fused_experts_fp8(x, self.w13, self.w2, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, intermediate_size={self.intermediate_size}, fp8 e4m3 "
            f"{self.w13.block_n}x{self.w13.block_k} blocks, W8A8"
        )
