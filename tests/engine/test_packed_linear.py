"""oneDNN-packed bf16 linears (engine/weights/formats/packed_linear.py): the packed GEMM gives what F.linear gives,
the runner packs a bf16 model's linears (not MoE routers; a tied lm_head as a copy), and the dense
copy of quantized linears falls back to float32 where bf16 is not native."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import engine.weights.formats.packed_linear as packed_linear
from engine.config import EngineConfig
from engine.front.offline import OfflineEngine
from engine.models.layers import Linear
from engine.weights.formats.packed_linear import DenseWeight, PackedLinear, can_pack
from scheduler.request import SamplingParams

CPU = torch.device("cpu")
needs_bf16 = pytest.mark.skipif(not can_pack(torch.bfloat16, CPU), reason="oneDNN has no native bf16 on this CPU")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 7, 32, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_the_packed_gemm_gives_what_f_linear_gives(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    linear = Linear(96, [40, 24], bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 96, generator=g))
        if linear.bias is not None:
            linear.bias.copy_(torch.randn(64, generator=g))
    linear = linear.to(torch.bfloat16)
    packed = PackedLinear.from_linear(linear)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))
    assert torch.equal(packed(x.view(1, rows, 96)), packed(x).view(1, rows, 64))
    assert packed.packed_nbytes == 64 * 96 * 2 and "oneDNN-packed" in repr(packed)


def test_float_dtypes_and_gpus_keep_their_gemm() -> None:
    assert not can_pack(torch.float32, CPU) and not can_pack(torch.bfloat16, torch.device("cuda"))


@needs_bf16
def test_the_runner_packs_a_bf16_models_linears(tmp_path: Path) -> None:
    from tests.factories import make_checkpoint

    path = make_checkpoint(tmp_path / "m", "llama", tie=True)
    e = OfflineEngine.from_config(EngineConfig(model=str(path), dtype="bfloat16", kv_cache_memory="4MiB"))
    model = e.core.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, PackedLinear)
    assert isinstance(model.layers[1].mlp.down_proj, PackedLinear)
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head_t is None  # a packed copy of the tied head
    assert model.embed_tokens.weight.dtype == torch.bfloat16  # the embedding keeps its own weight
    assert e.core.runner.weight_nbytes > sum(p.nbytes for p in model.parameters())  # packed bytes counted
    plain = OfflineEngine.from_config(EngineConfig(model=str(path), dtype="float32", kv_cache_memory="4MiB"))
    assert isinstance(plain.core.runner.model.layers[0].self_attn.qkv_proj, Linear)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [[5, 17, 42, 99, 7]]
    assert e.generate(prompt, params)[0].token_ids[0][:3] == plain.generate(prompt, params)[0].token_ids[0][:3]


def test_moe_routers_stay_plain_linears(tmp_path: Path) -> None:
    from tests.factories import make_moe_checkpoint

    path = make_moe_checkpoint(tmp_path / "moe")
    model = OfflineEngine.from_config(
        EngineConfig(model=str(path), dtype="bfloat16", kv_cache_memory="4MiB")
    ).core.runner.model
    gates = [m.gate for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    assert gates and all(isinstance(g, Linear) for g in gates)


def test_dense_weight_runs_float32_where_bf16_is_not_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without native bf16 the copy is float32 (MKL), the bf16 activations cast there and back."""
    monkeypatch.setattr(packed_linear, "can_pack", lambda dtype, device: False)
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g).to(torch.bfloat16)
    dense = DenseWeight(w, torch.bfloat16)
    assert not dense.packed and dense.weight.dtype == torch.float32 and dense.nbytes == 24 * 40 * 4
    x = torch.randn(9, 40, generator=g).to(torch.bfloat16)
    assert torch.equal(dense(x, b), F.linear(x.float(), w, b.float()).to(torch.bfloat16))
    assert DenseWeight(w, torch.float32).weight.dtype == torch.float32
