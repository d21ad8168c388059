"""The sparse mixture-of-experts block that takes a decoder layer's MLP slot: a float32 router,
the experts (float or NVFP4, run by kernels.fused_moe), and an optional sigmoid-gated shared
expert (Qwen3.5-MoE). Self-contained: it needs only the hidden size and a `MoeConfig`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers import Linear
from engine.weights.config.moe_config import MoeConfig
from kernels.fused_moe import NVFP4ExpertWeights, route, select_experts
from kernels.moe_dispatch import ExpertOperand, fused_experts, prepare_experts


class Experts(nn.Module):
    """Every expert's SwiGLU weights in the model dtype, stacked as the fused kernel reads them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        # [E, 2I, H]: gate rows then up rows; [E, H, I]
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.w13, self.w2, topk_weights, topk_ids)


class NVFP4Experts(nn.Module):
    """Every expert's weights in NVFP4 (per-expert global scales), prepared once for the device.
    NOTE: like NVFP4Linear, the operands are not buffers: build it on its final device."""

    def __init__(self, w13: NVFP4ExpertWeights, w2: NVFP4ExpertWeights) -> None:
        super().__init__()
        self.num_experts = w13.num_experts
        self.intermediate_size = w2.shape[1]
        self.weight_nbytes = w13.nbytes + w2.nbytes  # resident: packed codes and all scales
        self.w13: ExpertOperand = prepare_experts(w13)
        self.w2: ExpertOperand = prepare_experts(w2)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.w13, self.w2, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, intermediate_size={self.intermediate_size}, nvfp4"


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP of its own width, seen by every token (Qwen3.5-MoE's `shared_expert`)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, [intermediate_size] * 2)
        self.down_proj = Linear(intermediate_size, [hidden_size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    """x [T, hidden] -> [T, hidden]. Parameter names follow the checkpoint's `mlp.*` names
    (`gate` is the router; `experts`; `shared_expert`, `shared_expert_gate`)."""

    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.top_k = moe.num_experts_per_tok
        self.renormalize = moe.norm_topk_prob
        # The router stays in the model dtype (never quantized at load); it is applied in float32.
        self.gate: nn.Module = Linear(hidden_size, [moe.num_experts])
        self.experts: nn.Module = Experts(moe.num_experts, hidden_size, moe.moe_intermediate_size)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, [1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.gate, Linear):
            topk_weights, topk_ids = route(x, self.gate.weight, self.top_k, self.renormalize)  # [T, k] fp32, int64
        else:  # a checkpoint that stored its router in NVFP4 (ModelOpt usually excludes it): run it as stored
            topk_weights, topk_ids = select_experts(self.gate(x).float(), self.top_k, self.renormalize)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
