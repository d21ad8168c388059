"""The fused-MoE Triton kernels compiled on a CUDA device (bf16 operands) against the float64
grouped reference, at Qwen3-Coder-30B-A3B's expert shapes; the dispatch picks them on CUDA.
NOTE: written without a GPU; these have never run (see kernels/fused_moe_triton.py)."""

import pytest
import torch

from engine.models.moe import NVFP4Experts
from kernels.fused_moe import NVFP4ExpertWeights, fused_experts_ref, route
from kernels.moe_dispatch import fused_experts
from kernels.nvfp4 import quantize_nvfp4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    from kernels import fused_moe_triton


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def experts(e: int, h: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return (
        torch.randn(e, 2 * i, h, generator=g, device="cuda") * 0.05,
        torch.randn(e, h, i, generator=g, device="cuda") * 0.05,
    )


def routing(t: int, e: int, h: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, h, generator=g, device="cuda").bfloat16()
    weights, ids = route(x, torch.randn(e, h, generator=g, device="cuda"), k, True)
    return x, weights, ids


@pytest.mark.parametrize("t", [1, 8, 64, 512])
def test_bf16_experts_match_reference(t: int) -> None:
    w13, w2 = experts(128, 2048, 768)
    x, weights, ids = routing(t, 128, 2048, 8)
    got = fused_experts(x, w13.bfloat16(), w2.bfloat16(), weights, ids)  # dispatch: Triton on CUDA
    want = fused_experts_ref(x.double(), w13.bfloat16().double(), w2.bfloat16().double(), weights.double(), ids)
    assert got.dtype == torch.bfloat16 and relative_error(got, want) <= 2e-2


@pytest.mark.parametrize("t", [1, 8, 64, 512])
def test_nvfp4_experts_match_reference(t: int) -> None:
    w13, w2 = experts(128, 2048, 768)
    q13 = NVFP4ExpertWeights.stack([[quantize_nvfp4(w[:768]), quantize_nvfp4(w[768:])] for w in w13])
    q2 = NVFP4ExpertWeights.stack([[quantize_nvfp4(w)] for w in w2])
    module = NVFP4Experts(q13, q2)
    assert isinstance(module.w13, fused_moe_triton.ExpertKernelLayout)
    x, weights, ids = routing(t, 128, 2048, 8)
    got = module(x, weights, ids)
    want = fused_experts_ref(x.double(), q13, q2, weights.double(), ids)
    assert relative_error(got, want) <= 2e-2
