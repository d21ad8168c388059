"""NVFP4 MoE experts: quantized at load per expert (each with its own global scales), written by
`fp4serve quantize` in the ModelOpt and compressed-tensors layouts from either expert layout and
loaded back to the same logits; the router stays float; resident bytes in the start-up log;
quality against the float model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.front.offline import OfflineEngine
from engine.models.layers import Linear
from engine.models.moe import NVFP4Experts, SparseMoeBlock
from fp4serve_tools.quantize import quantize_checkpoint
from kernels.fused_moe import NVFP4ExpertWeights
from kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from kernels.nvfp4_scale_search import quantize_nvfp4_searched
from scheduler.request import SamplingParams
from tests.engine.test_nvfp4_engine import make_runner, position_logits, random_prompts
from tests.factories import make_moe_checkpoint

CPU = torch.device("cpu")
FORMATS = ("modelopt", "compressed-tensors")
E, H, I = 8, 64, 32  # noqa: E741  experts, hidden, moe_intermediate_size of the factory's model
MIB = 1 << 20


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str | None], Path]:
    """(source layout "per" | "fused", format or None) -> a float MoE checkpoint or its NVFP4 copy."""
    cache: dict[tuple[str, str | None], Path] = {}

    def get(layout: str, fmt: str | None = None) -> Path:
        if (layout, fmt) not in cache:
            if fmt is None:
                cache[layout, fmt] = make_moe_checkpoint(
                    tmp_path_factory.mktemp(layout), seed=3, mlp_only_layers=[1], fused_experts=layout == "fused"
                )
            else:
                dst = tmp_path_factory.mktemp(f"{layout}-{fmt}") / "out"
                quantize_checkpoint(get(layout), dst, fmt, CPU)
                cache[layout, fmt] = dst
        return cache[layout, fmt]

    return get


def moe_blocks(runner: Any) -> dict[int, SparseMoeBlock]:
    return {i: layer.mlp for i, layer in enumerate(runner.model.layers) if isinstance(layer.mlp, SparseMoeBlock)}


def test_quantize_at_load_gives_each_expert_its_own_global_scales(ckpts: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="fp4serve.loader")
    src = ckpts("per")
    runner = make_runner(src, quantization="nvfp4")
    tensors = load_file(src / "model.safetensors")
    blocks = moe_blocks(runner)
    assert sorted(blocks) == [0, 2]
    nbytes = 0
    for layer, block in blocks.items():
        assert type(block.gate) is Linear  # the router stays float
        assert torch.equal(block.gate.weight, tensors[f"model.layers.{layer}.mlp.gate.weight"])
        experts = block.experts
        assert isinstance(experts, NVFP4Experts) and isinstance(experts.w13, NVFP4ExpertWeights)
        assert isinstance(experts.w2, NVFP4ExpertWeights)
        assert experts.w13.global_scale.shape == (E, 2) and experts.w2.global_scale.shape == (E, 1)
        for e in (0, 7):
            prefix = f"model.layers.{layer}.mlp.experts.{e}"
            # Quantized at load with the searched block scales, as every linear (engine/weights/formats/nvfp4.py).
            gate = quantize_nvfp4_searched(tensors[f"{prefix}.gate_proj.weight"])
            up = quantize_nvfp4_searched(tensors[f"{prefix}.up_proj.weight"])
            want = torch.cat([dequantize_nvfp4(gate, torch.float32), dequantize_nvfp4(up, torch.float32)])
            assert torch.equal(dequantize_nvfp4(experts.w13.expert(e), torch.float32), want)
            assert experts.w13.global_scale[e].tolist() == [gate.global_scale.item(), up.global_scale.item()]
        assert len(set(experts.w2.global_scale.flatten().tolist())) == E  # one scale per expert
        nbytes += experts.weight_nbytes
    # codes (1/2 byte per element), one E4M3 scale per 16, fp32 global scales: gate, up per expert, down
    per_block = E * (2 * I * H // 2 + 2 * I * H // 16 + 2 * 4) + E * (H * I // 2 + H * I // 16 + 4)
    assert nbytes == 2 * per_block
    assert (
        f"moe: 2 sparse layers x {E} experts (2 active per token); experts resident {nbytes / MIB:.2f} MiB (nvfp4)"
        in caplog.messages
    )
    assert runner.nvfp4_weight_nbytes >= nbytes


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["per", "fused"])
def test_written_moe_checkpoint_loads_to_the_logits_of_quantize_at_load(ckpts: Any, layout: str, fmt: str) -> None:
    written = ckpts(layout, fmt)
    names = load_file(written / "model.safetensors").keys()
    marker = "weight_scale" if fmt == "modelopt" else "weight_packed"
    assert f"model.layers.2.mlp.experts.5.down_proj.{marker}" in names  # per expert, also from a fused source
    assert "model.layers.2.mlp.gate.weight" in names and "model.layers.2.mlp.gate.weight_scale" not in names
    at_load, loaded = make_runner(ckpts("per"), quantization="nvfp4"), make_runner(written)
    for block in moe_blocks(loaded).values():
        assert isinstance(block.experts, NVFP4Experts) and type(block.gate) is Linear
    for prompt in random_prompts([7, 33], seed=2):
        a, b = position_logits(at_load, prompt), position_logits(loaded, prompt)
        assert (a - b).abs().max().item() <= 1e-4  # ModelOpt stores 1/S: S back within an ulp


def test_modelopt_moe_checkpoint_with_w4a4_input_scales_loads_weight_only(
    ckpts: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    dst = tmp_path / "w4a4"
    shutil.copytree(ckpts("per", "modelopt"), dst)
    tensors = load_file(dst / "model.safetensors")
    scales = {
        n.replace(".weight_scale_2", ".input_scale"): torch.tensor(0.01)
        for n in tensors
        if n.endswith(".weight_scale_2")
    }
    tensors.update(scales)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    caplog.set_level("INFO", logger="fp4serve.loader")
    runner = make_runner(dst)
    assert isinstance(moe_blocks(runner)[0].experts, NVFP4Experts)
    num_expert_scales = sum(".experts." in n for n in scales)
    assert num_expert_scales == 2 * E * 3
    assert f"skipped {num_expert_scales} W4A4 expert activation scales: weight-only NVFP4" in caplog.messages


def test_missing_packed_expert_scale_is_named(ckpts: Any, tmp_path: Path) -> None:
    import shutil

    dst = tmp_path / "broken"
    shutil.copytree(ckpts("per", "compressed-tensors"), dst)
    tensors = load_file(dst / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.4.up_proj.weight_global_scale"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"missing tensor for 'model\.layers\.0\.mlp\.experts\.4\.up_proj\."):
        make_runner(dst)


def test_nvfp4_moe_serves_and_agrees_with_its_float_self(tmp_path: Path) -> None:
    src = make_moe_checkpoint(tmp_path / "m", seed=5, init_std=0.02)
    float_runner, nvfp4_runner = make_runner(src), make_runner(src, quantization="nvfp4")
    agree = total = 0
    for prompt in random_prompts([50, 50, 50, 50], seed=11):
        ref, got = position_logits(float_runner, prompt), position_logits(nvfp4_runner, prompt)
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        total += len(prompt)
    print(f"NVFP4 MoE vs float top-1 next-token agreement: {agree}/{total} = {agree / total:.3f}")
    assert total == 200 and agree / total >= 0.6
    engine = OfflineEngine.from_config(
        EngineConfig(
            model=str(src), dtype="float32", kv_cache_memory="2MiB", quantization="nvfp4", max_num_batched_tokens=7
        )
    )
    results = engine.generate(
        random_prompts([3, 20, 41], seed=1), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    assert [len(r.token_ids[0]) for r in results] == [10, 10, 10]


def test_a_router_stored_in_nvfp4_is_loaded_as_stored_and_serves(ckpts: Any, tmp_path: Path) -> None:
    """ModelOpt usually excludes `mlp.gate`; a checkpoint that did quantize it still loads."""
    import shutil

    from kernels.nvfp4 import to_modelopt
    from kernels.nvfp4_matmul import NVFP4Linear

    dst = tmp_path / "q-router"
    shutil.copytree(ckpts("per", "modelopt"), dst)
    tensors = load_file(dst / "model.safetensors")
    router = tensors.pop("model.layers.0.mlp.gate.weight")
    tensors.update({f"model.layers.0.mlp.gate.{k}": v for k, v in to_modelopt(quantize_nvfp4(router)).items()})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    runner = make_runner(dst)
    blocks = moe_blocks(runner)
    assert isinstance(blocks[0].gate, NVFP4Linear) and type(blocks[2].gate) is Linear
    assert position_logits(runner, random_prompts([9], seed=4)[0]).isfinite().all()
