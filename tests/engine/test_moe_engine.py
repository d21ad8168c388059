"""Qwen3-MoE in the engine against transformers (float32): every step's logits and batched greedy
decoding under concurrency and forced chunked prefill, dense and MoE layers mixed through
mlp_only_layers / decoder_sparse_step, norm_topk_prob both ways, both expert layouts; config
and checkpoint errors named in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ConfigError
from engine.models.decoder import MLP
from engine.models.moe import Experts, SparseMoeBlock
from engine.weights.config.model_config import ModelConfig
from scheduler.request import SamplingParams
from tests.engine.test_engine_correctness import capture_logits, hf_greedy, make_engine, prompts_for
from tests.factories import make_moe_checkpoint

# name -> Qwen3MoeConfig overrides (3 layers)
CONFIGS: dict[str, dict[str, Any]] = {
    "dense-middle-norm": dict(mlp_only_layers=[1], norm_topk_prob=True),
    "every-2nd-no-norm": dict(decoder_sparse_step=2, norm_topk_prob=False, num_experts_per_tok=3),
    "all-moe-top1": dict(num_experts_per_tok=1, norm_topk_prob=False),
}


@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: make_moe_checkpoint(tmp_path_factory.mktemp(name), seed=i, **kw)
        for i, (name, kw) in enumerate(CONFIGS.items())
    }


def test_layers_follow_mlp_only_layers_and_decoder_sparse_step(moe_ckpts: dict[str, Path]) -> None:
    kinds = {}
    for name, path in moe_ckpts.items():
        engine = make_engine(path)
        kinds[name] = [type(layer.mlp).__name__ for layer in engine.core.runner.model.layers]
    assert kinds == {
        "dense-middle-norm": ["SparseMoeBlock", "MLP", "SparseMoeBlock"],
        "every-2nd-no-norm": ["MLP", "SparseMoeBlock", "MLP"],
        "all-moe-top1": ["SparseMoeBlock"] * 3,
    }
    cfg = ModelConfig.from_checkpoint(moe_ckpts["every-2nd-no-norm"])
    assert cfg.moe is not None and (cfg.moe.num_experts, cfg.moe.num_experts_per_tok) == (8, 3)
    assert not cfg.moe.norm_topk_prob and cfg.qk_norm


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_step_logits_match_transformers(moe_ckpts: dict[str, Path], name: str) -> None:
    path = moe_ckpts[name]
    prompt = prompts_for(512)[5]  # 40 tokens
    ref_tokens, ref_logits = hf_greedy(path, prompt, 8)
    engine = make_engine(path)
    seen = capture_logits(engine)
    [result] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert result.token_ids[0] == ref_tokens
    for step, (a, b) in enumerate(zip(seen[f"{result.request_id}#0"], ref_logits)):
        assert (a - b).abs().max().item() <= 1e-4, f"step {step}"


@pytest.mark.parametrize(
    "name,block_size,max_batched",
    [("dense-middle-norm", 16, 4096), ("every-2nd-no-norm", 4, 7)],
    ids=["concurrent", "concurrent-chunked"],
)
def test_concurrent_greedy_equals_transformers_alone(
    moe_ckpts: dict[str, Path], name: str, block_size: int, max_batched: int
) -> None:
    path = moe_ckpts[name]
    prompts = prompts_for(512)
    refs = [hf_greedy(path, p, 12)[0] for p in prompts]
    engine = make_engine(path, block_size=block_size, max_num_batched_tokens=max_batched)
    results = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [r.token_ids[0] for r in results] == refs
    if max_batched < 64:  # the long prompts really were split into chunks
        assert engine.timings.num_steps > 12 + max(len(p) for p in prompts) // max_batched


def test_fused_expert_layout_loads_to_the_same_model(tmp_path: Path) -> None:
    per_expert = make_moe_checkpoint(tmp_path / "per", seed=7, mlp_only_layers=[0])
    fused = make_moe_checkpoint(tmp_path / "fused", seed=7, mlp_only_layers=[0], fused_experts=True)
    names = load_file(fused / "model.safetensors").keys()
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    assert not any(".experts.0." in n for n in names)
    a, b = make_engine(per_expert).core.runner.model, make_engine(fused).core.runner.model
    for layer in (1, 2):
        ea, eb = a.layers[layer].mlp.experts, b.layers[layer].mlp.experts
        assert isinstance(ea, Experts) and isinstance(eb, Experts)
        assert torch.equal(ea.w13, eb.w13) and torch.equal(ea.w2, eb.w2)
    prompt = prompts_for(512)[2]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert make_engine(fused).generate([prompt], params)[0].token_ids[0] == hf_greedy(per_expert, prompt, 8)[0]


def test_experts_hold_the_checkpoint_tensors_in_place(tmp_path: Path) -> None:
    path = make_moe_checkpoint(tmp_path / "m", seed=2)
    tensors = load_file(path / "model.safetensors")
    block = make_engine(path).core.runner.model.layers[2].mlp
    assert isinstance(block, SparseMoeBlock) and isinstance(block.experts, Experts)
    i = block.experts.intermediate_size
    for e in (0, 5):
        prefix = f"model.layers.2.mlp.experts.{e}"
        assert torch.equal(block.experts.w13[e, :i], tensors[f"{prefix}.gate_proj.weight"])
        assert torch.equal(block.experts.w13[e, i:], tensors[f"{prefix}.up_proj.weight"])
        assert torch.equal(block.experts.w2[e], tensors[f"{prefix}.down_proj.weight"])
    assert torch.equal(block.gate.weight, tensors["model.layers.2.mlp.gate.weight"])


def _edit(path: Path, tensors_fn: Any = None, config_fn: Any = None) -> None:
    if tensors_fn is not None:
        tensors = load_file(path / "model.safetensors")
        tensors_fn(tensors)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if config_fn is not None:
        raw = json.loads((path / "config.json").read_text())
        config_fn(raw)
        (path / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    "case,fragment",
    [
        ("missing-expert", "missing tensor for 'model.layers.1.mlp.experts.3.up_proj.weight'"),
        (
            "expert-shape",
            "tensor 'model.layers.0.mlp.experts.2.down_proj.weight' has shape [64, 16], expected [64, 32]",
        ),
        ("expert-out-of-range", "expert 9 of a model with 8 experts"),
        ("dense-layer-expert", "layer 1 is not a MoE layer"),
        ("top-k", "field 'num_experts_per_tok' (9) exceeds num_experts (8)"),
        ("no-experts", "field 'num_experts' must be a positive integer"),
    ],
)
def test_bad_moe_checkpoints_fail_with_one_line_naming_the_tensor_or_field(
    tmp_path: Path, case: str, fragment: str
) -> None:
    path = make_moe_checkpoint(tmp_path / "m", seed=1)
    if case == "missing-expert":
        _edit(path, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    elif case == "expert-shape":
        _edit(path, lambda t: t.update({"model.layers.0.mlp.experts.2.down_proj.weight": torch.zeros(64, 16)}))
    elif case == "expert-out-of-range":
        _edit(path, lambda t: t.update({"model.layers.0.mlp.experts.9.down_proj.weight": torch.zeros(64, 32)}))
    elif case == "dense-layer-expert":
        _edit(path, config_fn=lambda c: c.update(mlp_only_layers=[1]))
    elif case == "top-k":
        _edit(path, config_fn=lambda c: c.update(num_experts_per_tok=9))
    else:
        _edit(path, config_fn=lambda c: (c.pop("num_local_experts", None), c.pop("num_experts", None)))
    with pytest.raises(ConfigError) as err:
        make_engine(path)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_dense_layers_of_a_moe_model_use_intermediate_size(tmp_path: Path) -> None:
    path = make_moe_checkpoint(tmp_path / "m", mlp_only_layers=[0, 2], intermediate_size=48)
    model = make_engine(path).core.runner.model
    dense = model.layers[0].mlp
    assert isinstance(dense, MLP) and dense.down_proj.weight.shape == (64, 48)
    assert isinstance(model.layers[1].mlp, SparseMoeBlock)
