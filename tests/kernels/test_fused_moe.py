"""The fused MoE pieces: the float32 router and the grouped torch reference against transformers'
modules (Qwen3-MoE's and Qwen3.5-MoE's with its sigmoid-gated shared expert), the block-aligned
sort, the per-expert NVFP4 stack, and the Triton kernels under TRITON_INTERPRET=1 (fp16) against
the reference."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

# NOTE: a declared test dependency (missing, the run stops: tests/conftest.py). Imported here, before any
# fixture sets TRITON_INTERPRET: triton keeps state from its first import.
import triton  # noqa: F401

from engine.models.moe import Experts, SparseMoeBlock
from engine.weights.config.moe_config import MoeConfig, moe_config_from_dict
from kernels.fused_moe import (
    NVFP4ExpertWeights,
    fused_experts_ref,
    moe_align_block_size,
    route,
)
from kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4


def per_token_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The definition, one token and one slot at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def random_experts(
    e: int, h: int, i: int, seed: int = 0, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, 2 * i, h, generator=g) * 0.1).to(dtype), (torch.randn(e, h, i, generator=g) * 0.1).to(dtype)


def random_routing(t: int, e: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, k] distinct per token
    return torch.rand(t, k, generator=g, dtype=torch.float64), ids


@pytest.mark.parametrize("t,e,k", [(1, 4, 2), (7, 8, 3), (20, 16, 1)])
def test_grouped_reference_equals_the_per_token_definition(t: int, e: int, k: int) -> None:
    w13, w2 = random_experts(e, 24, 8)
    x = torch.randn(t, 24, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    weights, ids = random_routing(t, e, k)
    got = fused_experts_ref(x, w13, w2, weights, ids)
    assert torch.allclose(got, per_token_moe(x, w13, w2, weights, ids), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm", [True, False])
def test_router_matches_transformers_topk_router(norm: bool) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm)
    router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(50, 32)
    _, want_weights, want_ids = router(x)
    weights, ids = route(x, router.weight, 4, norm)
    assert weights.dtype == torch.float32 and torch.equal(ids, want_ids)
    assert torch.allclose(weights, want_weights, rtol=1e-6, atol=1e-7)
    assert torch.allclose(weights.sum(-1), torch.ones(50)) == norm


def test_bf16_model_routes_in_float32() -> None:
    """A bf16 softmax would round the probabilities to 8 bits and re-rank near-ties."""
    x = torch.randn(64, 32)
    gate = torch.randn(128, 32) * 0.01  # near-uniform router: many near-ties
    weights, ids = route(x.bfloat16(), gate.bfloat16(), 8, True)
    want_weights, want_ids = route(x.bfloat16().float(), gate.bfloat16().float(), 8, True)
    assert weights.dtype == torch.float32 and torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


def test_shared_expert_block_matches_transformers_qwen3_5_moe_block() -> None:
    """The self-contained block with Qwen3.5-MoE's sigmoid-gated shared expert, against
    transformers' Qwen3_5MoeSparseMoeBlock with the same weights."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    hf_cfg = Qwen3_5MoeTextConfig(
        hidden_size=48,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
    )
    torch.manual_seed(0)
    hf = Qwen3_5MoeSparseMoeBlock(hf_cfg).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    moe = moe_config_from_dict(hf_cfg.to_dict(), "qwen3_5_moe_text", "config.json")
    assert moe is not None and moe.norm_topk_prob and moe.shared_expert_intermediate_size == 24
    ours = SparseMoeBlock(48, moe)
    sd = hf.state_dict()
    with torch.no_grad():
        ours.gate.weight.copy_(sd["gate.weight"])
        assert isinstance(ours.experts, Experts)
        ours.experts.w13.copy_(sd["experts.gate_up_proj"])
        ours.experts.w2.copy_(sd["experts.down_proj"])
        assert ours.shared_expert is not None and ours.shared_expert_gate is not None
        ours.shared_expert.gate_up_proj.weight.copy_(
            torch.cat([sd["shared_expert.gate_proj.weight"], sd["shared_expert.up_proj.weight"]])
        )
        ours.shared_expert.down_proj.weight.copy_(sd["shared_expert.down_proj.weight"])
        ours.shared_expert_gate.weight.copy_(sd["shared_expert_gate.weight"])
        x = torch.randn(2, 13, 48)
        want = hf(x).reshape(26, 48)
        got = ours(x.reshape(26, 48))
    assert (got - want).abs().max().item() <= 1e-5
    ours.shared_expert = None  # without the shared expert the result moves: it was really there
    with torch.no_grad():
        assert (ours(x.reshape(26, 48)) - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("t,e,k,block_m", [(1, 8, 2, 16), (9, 4, 2, 4), (40, 16, 8, 16), (3, 128, 8, 16)])
def test_align_pads_each_expert_run_to_whole_tiles(t: int, e: int, k: int, block_m: int) -> None:
    _, ids = random_routing(t, e, k, seed=t)
    sorted_ids, block_expert, num_padded = moe_align_block_size(ids, block_m, e)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=e)
    assert int(num_padded) == int(((counts + block_m - 1) // block_m * block_m).sum())
    valid = sorted_ids[sorted_ids < t * k]
    assert sorted(valid.tolist()) == list(range(t * k))  # every slot exactly once
    assert bool((sorted_ids[int(num_padded) :] == t * k).all())
    for b in range(sorted_ids.numel() // block_m):
        tile = sorted_ids[b * block_m : (b + 1) * block_m]
        if b * block_m >= int(num_padded):
            assert int(block_expert[b]) == -1
            continue
        real = tile[tile < t * k]
        assert real.numel() > 0 and bool((flat[real.long()] == block_expert[b]).all())


def test_nvfp4_expert_stack_keeps_each_experts_gate_and_up_scales() -> None:
    g = torch.Generator().manual_seed(0)
    shards = [
        [quantize_nvfp4(torch.randn(16, 32, generator=g) * s), quantize_nvfp4(torch.randn(16, 32, generator=g))]
        for s in (0.01, 1.0, 100.0)
    ]
    stacked = NVFP4ExpertWeights.stack(shards)
    assert stacked.global_scale.shape == (3, 2) and stacked.shard_sizes == (16, 16)
    for e, (gate, up) in enumerate(shards):
        want = torch.cat([dequantize_nvfp4(gate, torch.float32), dequantize_nvfp4(up, torch.float32)])
        assert torch.equal(dequantize_nvfp4(stacked.expert(e), torch.float32), want)


# --- the Triton kernels, interpreted --------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_triton() -> Iterator[ModuleType]:
    """kernels.fused_moe_triton with its kernels interpreted (see tests/kernels/test_nvfp4_matmul.py)."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        modules = []
        for name in ("kernels.nvfp4_triton", "kernels.fused_moe_triton"):
            modules.append(
                importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
            )
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    yield modules[1]
    for module in modules:
        importlib.reload(module)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


# (tokens, experts, top-k, hidden, intermediate): decode-like, a K tail, more rows than a tile.
SHAPES = [(1, 4, 2, 64, 32), (5, 8, 3, 80, 48), (24, 4, 2, 64, 32)]


@pytest.mark.parametrize("t,e,k,h,i", SHAPES)
def test_float_kernel_matches_reference_fp16(moe_triton: ModuleType, t: int, e: int, k: int, h: int, i: int) -> None:
    w13, w2 = random_experts(e, h, i, seed=t)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    weights, ids = random_routing(t, e, k, seed=t + 1)
    got = moe_triton.fused_experts_triton(
        x.half(),
        w13.half(),
        w2.half(),
        weights.float(),
        ids,
        config=moe_triton.MoEConfig(block_m=16, block_n=32, block_k=32),
    )
    want = fused_experts_ref(x.half().double(), w13.half().double(), w2.half().double(), weights, ids)
    assert got.dtype == torch.float16 and got.shape == (t, h)
    assert relative_error(got, want) < 3e-3


@pytest.mark.parametrize("t,e,k,h,i", SHAPES)
def test_nvfp4_kernel_matches_reference_fp16(moe_triton: ModuleType, t: int, e: int, k: int, h: int, i: int) -> None:
    w13, w2 = random_experts(e, h, i, seed=t, dtype=torch.float32)
    q13 = NVFP4ExpertWeights.stack([[quantize_nvfp4(w[:i]), quantize_nvfp4(w[i:])] for w in w13])
    q2 = NVFP4ExpertWeights.stack([[quantize_nvfp4(w)] for w in w2])
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(9)).half()
    weights, ids = random_routing(t, e, k, seed=t + 1)
    got = moe_triton.fused_experts_triton(
        x,
        moe_triton.pack_expert_layout(q13),
        moe_triton.pack_expert_layout(q2),
        weights.float(),
        ids,
        config=moe_triton.MoEConfig(block_m=16, block_n=32),
    )
    want = fused_experts_ref(x.double(), q13, q2, weights, ids)  # the dequantized experts, in float64
    assert relative_error(got, want) < 3e-3


def test_expert_layout_round_trips_every_experts_codes(moe_triton: ModuleType) -> None:
    from kernels.nvfp4 import unpack_e2m1
    from kernels.nvfp4_triton import KernelLayout, unpack_kernel_layout

    w13, _ = random_experts(3, 80, 16, dtype=torch.float32)
    q = NVFP4ExpertWeights.stack([[quantize_nvfp4(w[:16]), quantize_nvfp4(w[16:])] for w in w13])
    layout = moe_triton.pack_expert_layout(q)
    assert layout.words.shape == (3, 32, 128 // 8)
    for e in range(3):
        one = KernelLayout(layout.words[e], layout.scale_words[e], layout.row_global_scale[e], layout.k)
        codes, scales = unpack_kernel_layout(one)
        assert torch.equal(codes, unpack_e2m1(q.packed[e]))
        assert torch.equal(scales.view(torch.uint8), q.block_scale[e].view(torch.uint8))
        assert torch.equal(layout.row_global_scale[e], q.row_global_scale()[e])


def test_moe_config_fields_are_validated() -> None:
    with pytest.raises(AssertionError):
        MoeConfig(num_experts=4, num_experts_per_tok=5, moe_intermediate_size=16, norm_topk_prob=True)
