"""The fused-MoE dispatch: the Triton kernels (kernels/fused_moe_triton.py) on CUDA, the grouped
torch reference (kernels/fused_moe.py) elsewhere. Its own module so that the kernel and the
reference it builds on do not import each other."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

import torch
from torch import Tensor

from kernels.fused_moe import NVFP4ExpertWeights, fused_experts_ref

if TYPE_CHECKING:
    from kernels.fused_moe_triton import ExpertKernelLayout

# A projection's weights as the dispatch takes them: float [E, N, K], NVFP4 for the torch
# reference, or NVFP4 re-laid for the Triton kernel.
ExpertOperand = Union[Tensor, NVFP4ExpertWeights, "ExpertKernelLayout"]


def prepare_experts(w: NVFP4ExpertWeights) -> NVFP4ExpertWeights | ExpertKernelLayout:
    """The operand for w's device, built once at load: the Triton layout on CUDA (SM80+), else w."""
    if w.packed.device.type == "cuda" and torch.cuda.get_device_capability(w.packed.device)[0] >= 8:
        from kernels.fused_moe_triton import pack_expert_layout

        return pack_expert_layout(w)
    return w


def fused_experts(x: Tensor, w13: ExpertOperand, w2: ExpertOperand, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    """The fused MoE on x's device: the Triton kernel on CUDA, the grouped torch reference else."""
    if x.device.type == "cuda" and not isinstance(w13, NVFP4ExpertWeights):
        from kernels.fused_moe_triton import fused_experts_triton

        return fused_experts_triton(x, w13, w2, topk_weights, topk_ids)
    assert isinstance(w13, (Tensor, NVFP4ExpertWeights)) and isinstance(w2, (Tensor, NVFP4ExpertWeights))
    return fused_experts_ref(x, w13, w2, topk_weights, topk_ids)
