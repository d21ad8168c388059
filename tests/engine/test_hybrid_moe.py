"""Qwen3.5-MoE (the hybrid Gated DeltaNet / gated-attention layers with a sparse MoE block and a
sigmoid-gated shared expert in every layer) against transformers in float32: batched greedy
decoding token for token over tiny random Qwen3_5MoeForCausalLM and
Qwen3_5MoeForConditionalGeneration checkpoints, several prompt lengths at once and with small
forced chunks; NVFP4 at load serves and agrees with the float model, and `fp4serve quantize`
writes checkpoints that load to the same logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.models.layers import Linear
from engine.models.moe import Experts, NVFP4Experts, SparseMoeBlock
from engine.weights.config.model_config import ModelConfig
from fp4serve_tools.quantize import quantize_checkpoint
from kernels.nvfp4_matmul import NVFP4Linear
from scheduler.request import SamplingParams
from tests.engine.test_engine_correctness import hf_greedy, make_engine
from tests.engine.test_hybrid_nvfp4 import make_runner, position_logits
from tests.factories import make_hybrid_moe_checkpoint

NUM_DECODE = 8
# 1 token; short; over a 16-token page; over one 64-token delta-rule chunk.
PROMPT_LENS = [1, 5, 17, 70]
LIN, FULL = "linear_attention", "full_attention"
CONFIGS: dict[str, dict[str, Any]] = {
    "causal-untied-top2": dict(layout="causal", tie=False),
    "vl-tied-top3-attn-first": dict(
        layout="vl", tie=True, num_experts_per_tok=3, seed=1, layer_types=[FULL, LIN, LIN, FULL]
    ),
}


def prompts(lengths: list[int] = PROMPT_LENS, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 510, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=list(CONFIGS))
def moe_hybrid(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[list[int]]]:
    """A checkpoint and transformers' greedy tokens for every prompt."""
    path = make_hybrid_moe_checkpoint(tmp_path_factory.mktemp(request.param), **CONFIGS[request.param])
    return path, [hf_greedy(path, p, NUM_DECODE)[0] for p in prompts()]


def greedy(path: Path, **engine_args: Any) -> tuple[list[list[int]], Any]:
    engine = make_engine(path, **engine_args)
    results = engine.generate(prompts(), SamplingParams(max_tokens=NUM_DECODE, temperature=0.0, ignore_eos=True))
    return [r.token_ids[0] for r in results], engine


def test_config_and_layers(moe_hybrid: tuple[Path, list[list[int]]]) -> None:
    path, _ = moe_hybrid
    cfg = ModelConfig.from_checkpoint(path)
    assert cfg.model_type == "qwen3_5_moe" and cfg.hybrid is not None and cfg.moe is not None
    assert cfg.moe.norm_topk_prob and cfg.moe.shared_expert_intermediate_size == 48
    assert cfg.intermediate_size == 48  # no dense MLP: the shared expert's width stands in
    model = make_engine(path).core.runner.model
    for layer in model.layers:  # every layer sparse, with its shared expert, at layers.{i}.mlp
        assert isinstance(layer.mlp, SparseMoeBlock) and isinstance(layer.mlp.experts, Experts)
        assert layer.mlp.shared_expert is not None and layer.mlp.shared_expert_gate is not None


def test_batched_greedy_equals_transformers(moe_hybrid: tuple[Path, list[list[int]]]) -> None:
    path, refs = moe_hybrid
    ours, _ = greedy(path)
    assert ours == refs


def test_small_forced_chunks_equal_transformers(moe_hybrid: tuple[Path, list[list[int]]]) -> None:
    path, refs = moe_hybrid
    ours, engine = greedy(path, max_num_batched_tokens=16, block_size=4)
    assert ours == refs
    assert engine.timings.num_steps > NUM_DECODE + max(PROMPT_LENS) // 16  # the long prompt was chunked


def test_nvfp4_at_load_serves_and_agrees_with_its_float_self(tmp_path: Path) -> None:
    # NOTE: weights of std 0.02, as the dense and hybrid agreement tests (random logits at larger
    # std are flat enough that NVFP4 noise flips most argmaxes). Measured 178/200 = 0.890 (2026-11-24).
    src = make_hybrid_moe_checkpoint(tmp_path / "m", layout="vl", init_std=0.02, seed=3)
    float_runner, nvfp4_runner = make_runner(src), make_runner(src, quantization="nvfp4")
    for layer in nvfp4_runner.model.layers:
        block = layer.mlp
        assert isinstance(block, SparseMoeBlock) and isinstance(block.experts, NVFP4Experts)
        assert isinstance(block.gate, Linear) and isinstance(block.shared_expert_gate, Linear)  # stay float
        assert block.shared_expert is not None
        assert isinstance(block.shared_expert.gate_up_proj, NVFP4Linear)
        assert isinstance(block.shared_expert.down_proj, NVFP4Linear)
    agree = total = 0
    for prompt in prompts([50, 50, 50, 50], seed=11):
        ref, got = position_logits(float_runner, prompt), position_logits(nvfp4_runner, prompt)
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        total += len(prompt)
    print(f"hybrid MoE NVFP4 vs float top-1 next-token agreement: {agree}/{total} = {agree / total:.3f}")
    assert total == 200 and agree / total >= 0.6
    engine = make_engine(src, quantization="nvfp4", max_num_batched_tokens=16, block_size=4)
    results = engine.generate(
        prompts([3, 30, 70], seed=2), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    assert [len(r.token_ids[0]) for r in results] == [8, 8, 8]


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_written_nvfp4_checkpoint_loads_like_quantize_at_load(tmp_path: Path, fmt: str) -> None:
    src = make_hybrid_moe_checkpoint(tmp_path / "m", layout="vl", seed=4)
    dst = tmp_path / "nvfp4"
    quantize_checkpoint(src, dst, fmt, torch.device("cpu"))
    written, at_load = make_runner(dst), make_runner(src, quantization="nvfp4")
    block = written.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock) and isinstance(block.experts, NVFP4Experts)
    assert block.shared_expert is not None and isinstance(block.shared_expert.down_proj, NVFP4Linear)
    for prompt in prompts([1, 40], seed=1):
        ref, got = position_logits(at_load, prompt), position_logits(written, prompt)
        assert (ref - got).abs().max() <= 1e-5 * ref.abs().max()
