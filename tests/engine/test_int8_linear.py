"""Weight-only int8 (`--quantization int8`): the kernel against a dequantized float reference, the
quantization's error bound, fused shards, the engine against transformers on a checkpoint whose
weights already lie on the int8 grid (so int8 changes nothing but the kernel), and the errors."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from api.cli import build_parser, server_config
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.front.offline import OfflineEngine
from engine.weights.config.model_config import ModelConfig
from engine.weights.formats.int8_linear import (
    Int8Linear,
    Int8LinearBuilder,
    check_int8_device,
    dequantize_int8,
    quantize_int8,
)
from engine.weights.formats.nvfp4 import INT8, detect_quantization, is_quantizable
from engine.weights.formats.packed_linear import can_pack
from engine.weights.loader import load_model
from scheduler.request import SamplingParams
from tests.engine.test_engine_correctness import capture_logits, hf_greedy
from tests.factories import make_checkpoint

PROMPT = [5, 17, 42, 99, 7, 300, 12, 64, 1, 250]


def reference(x: torch.Tensor, linear: Int8Linear) -> torch.Tensor:
    """The same math in float32 with the weight widened: x (codes * scales)^T + b."""
    w = dequantize_int8(linear.weight_codes, linear.scales)  # [N, K] float32
    bias = None if linear.bias is None else linear.bias.float()
    return F.linear(x.float(), w, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# K = 100, 8: not a multiple of 16, which torch's bf16 kernel needs (Int8Linear pads)
@pytest.mark.parametrize("shape", [(1, 64, 96), (7, 576, 960), (32, 100, 37), (1, 8, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_the_dequantized_float_reference(
    dtype: torch.dtype, shape: tuple[int, int, int], bias: bool
) -> None:
    tokens, k, n = shape
    g = torch.Generator().manual_seed(tokens * k + n)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    linear = Int8Linear.from_float(w, b, dtype)
    x = torch.randn(tokens, k, generator=g).to(dtype)
    y = linear(x)
    assert y.dtype == dtype and y.shape == (tokens, n)
    ref = reference(x, linear)
    if dtype == torch.float32:  # only the summation order differs
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    else:  # float32 accumulation, then the output (and the bias add) rounded to bf16: a few ulps
        torch.testing.assert_close(y.float(), ref, rtol=2**-6, atol=2**-6)


def test_int8_linear_takes_any_leading_shape_and_strided_input() -> None:
    w = torch.randn(48, 64)
    linear = Int8Linear.from_float(w, None, torch.bfloat16)
    x = torch.randn(2, 3, 128).to(torch.bfloat16)[..., ::2]  # [2, 3, 64], stride 2 in the last dim
    y = linear(x)
    assert y.shape == (2, 3, 48)
    assert torch.equal(y, linear(x.contiguous().view(6, 64)).view(2, 3, 48))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_round_trip_error_is_bounded_per_row(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different sizes
    w[5] = 0.0  # an all-zero row
    codes, scales = quantize_int8(w, dtype)
    assert codes.dtype == torch.int8 and scales.dtype == dtype and codes.abs().max() <= 127
    err = (dequantize_int8(codes, scales) - w).abs().amax(dim=1)  # [N]
    step = scales.float()
    # Half a step from rounding; a bf16 scale rounded below amax/127 may also clip the largest
    # element by up to half a step more.
    bound = step * (0.5 if dtype == torch.float32 else 1.0) * (1 + 1e-6)
    assert torch.all(err <= bound), (err / step).max()
    assert torch.all(err[w.abs().amax(1) > 0] <= w.abs().amax(1)[w.abs().amax(1) > 0] / 127)  # <= 1/127 of the row
    assert torch.equal(codes[5], torch.zeros(256, dtype=torch.int8)) and scales[5] == 1


def test_builder_fuses_shards_arriving_in_any_order_exactly() -> None:
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(n, 32, generator=g) for n in (16, 8, 8)]
    bias = torch.zeros(32)
    builder = Int8LinearBuilder(["q", "k", "v"], [16, 8, 8], 32, bias, torch.bfloat16, torch.device("cpu"))
    for shard in (2, 0, 1):
        builder.add(shard, "weight", parts[shard])
        builder.add(shard, "bias", torch.full((parts[shard].shape[0],), float(shard)))
    fused = builder.build()
    codes, scales = zip(*(quantize_int8(p, torch.bfloat16) for p in parts))
    assert torch.equal(fused.weight_codes, torch.cat(codes)) and torch.equal(fused.scales, torch.cat(scales))
    assert fused.bias is not None and fused.bias.tolist() == [0.0] * 16 + [1.0] * 8 + [2.0] * 8


def test_builder_names_a_missing_shard_and_a_foreign_tensor() -> None:
    builder = Int8LinearBuilder(["m.gate_proj", "m.up_proj"], [8, 8], 16, None, torch.float32, torch.device("cpu"))
    builder.add(0, "weight", torch.randn(8, 16))
    with pytest.raises(ConfigError, match="missing tensor for 'm.up_proj.weight'"):
        builder.build()
    with pytest.raises(ConfigError, match="m.up_proj.weight_scale' is a quantization tensor"):
        builder.add(1, "weight_scale", torch.ones(8))
    with pytest.raises(ConfigError, match=r"m.up_proj.weight' has shape \[8, 15\]"):
        builder.add(1, "weight", torch.randn(8, 15))


def snap_to_int8_grid(path: Path) -> None:
    """Rewrite the checkpoint so each int8-quantized weight (and the embedding, the tied lm_head)
    is codes * 2^-e per row, with a +-127 in every row: int8 quantization then gives back exactly
    these values, in float32 and in bf16."""
    tensors = load_file(str(path / "model.safetensors"))
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if not (is_quantizable(module) or module in ("model.embed_tokens", "lm_head")):
            continue
        scale = torch.exp2(torch.ceil(torch.log2(w.abs().amax(1) / 127)))  # [N], a power of two
        codes = torch.round(w / scale[:, None]).clamp(-127, 127)
        top = w.abs().argmax(1)
        codes[torch.arange(len(top)), top] = 127 * torch.sign(w[torch.arange(len(top)), top])
        tensors[name] = (codes * scale[:, None]).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def on_grid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("int8grid"), "llama", tie=True, init_std=0.1)
    snap_to_int8_grid(path)
    return path


def engine(path: Path, **overrides: Any) -> OfflineEngine:
    return OfflineEngine.from_config(EngineConfig(model=str(path), kv_cache_memory="4MiB", **overrides))


def greedy_with_logits(e: OfflineEngine, num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    seen = capture_logits(e)
    [result] = e.generate([PROMPT], SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    return result.token_ids[0], next(iter(seen.values()))


def test_int8_float32_activations_equal_transformers_on_grid_weights(
    on_grid: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="fp4serve"):
        e = engine(on_grid, dtype="float32", quantization="int8")
    model = e.core.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, Int8Linear)  # fused q/k/v
    assert isinstance(model.layers[1].mlp.gate_up_proj, Int8Linear)  # fused gate/up
    assert isinstance(model.lm_head, Int8Linear) and model.embed_tokens.weight.dtype == torch.float32
    assert any(
        "int8: 9 linears quantized at load" in r.getMessage() and "lm_head int8 too" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    ours, logits = greedy_with_logits(e, 12)
    ref_tokens, ref_logits = hf_greedy(on_grid, PROMPT, 12)
    assert ours == ref_tokens
    for step, (a, b) in enumerate(zip(logits, ref_logits)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")


def test_int8_bf16_activations_track_the_bf16_float_run_on_grid_weights(on_grid: Path) -> None:
    """Same weights exactly (bf16 holds codes * 2^-e), so only the kernels' rounding differs."""
    ours, logits = greedy_with_logits(engine(on_grid, dtype="bfloat16", quantization="int8"), 8)
    theirs, ref_logits = greedy_with_logits(engine(on_grid, dtype="bfloat16"), 8)
    assert ours[:4] == theirs[:4]
    spread = ref_logits[0].max() - ref_logits[0].min()
    assert (logits[0] - ref_logits[0]).abs().max() < 0.03 * spread


def test_int8_of_arbitrary_float_weights_stays_close_to_float32(qwen3_ckpt: Path) -> None:
    """Real rounding now (Qwen3, q/k norms, biasless): the first steps' logits move by well under
    a percent of their spread and the greedy tokens start the same."""
    ours, logits = greedy_with_logits(engine(qwen3_ckpt, dtype="float32", quantization="int8"), 6)
    theirs, ref_logits = greedy_with_logits(engine(qwen3_ckpt, dtype="float32"), 6)
    assert ours[:3] == theirs[:3]
    spread = ref_logits[0].max() - ref_logits[0].min()
    assert (logits[0] - ref_logits[0]).abs().max() < 0.02 * spread


def test_int8_on_cuda_fails_before_any_weight_moves(on_grid: Path) -> None:
    with pytest.raises(ConfigError, match="--quantization int8: CPU only"):
        check_int8_device(torch.device("cuda"))
    method = detect_quantization(on_grid, None, "int8")
    assert method is not None and method.scheme == INT8 and method.quantize_at_load
    assert "int8" in method.describe() and "per output channel" in method.describe()
    with pytest.raises(ConfigError, match="CPU only"):  # checked before CUDA is touched
        load_model(on_grid, ModelConfig.from_checkpoint(on_grid), torch.bfloat16, torch.device("cuda"), 64, method)


def test_int8_refuses_an_already_quantized_checkpoint(tmp_path: Path) -> None:
    nvfp4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    with pytest.raises(ConfigError, match="int8: the checkpoint is already quantized .config.json"):
        detect_quantization(tmp_path, nvfp4, "int8")
    (tmp_path / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "NVFP4"}}')
    with pytest.raises(ConfigError, match="already quantized .hf_quant_config.json"):
        detect_quantization(tmp_path, None, "int8")
    with pytest.raises(ConfigError, match="'int2' is not one of nvfp4, int8, int4"):
        detect_quantization(tmp_path, None, "int2")


def test_the_flag_reaches_the_engine_config_and_the_help() -> None:
    parser = build_parser()
    assert server_config(parser.parse_args(["serve", "--quantization", "int8"])).engine.quantization == "int8"
    serve = next(
        a
        for a in parser._subparsers._group_actions[0].choices.values()  # type: ignore[union-attr]
        if any("--quantization" in o.option_strings for o in a._actions)
    )
    help_text = " ".join(serve.format_help().split())
    assert "{auto,none,nvfp4,int8,int4}" in help_text and "int8 (CPU only" in help_text
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--quantization", "int2"])


@pytest.mark.parametrize("moe", [False, True], ids=["hybrid", "hybrid-moe"])
def test_hybrid_models_quantize_their_projections_and_keep_experts_float(tmp_path: Path, moe: bool) -> None:
    """Qwen3.5: DeltaNet qkv/z (fused) and out projections, attention and shared-expert linears
    become int8; in_proj_a/b, the router and the routed experts stay float."""
    from tests.factories import make_hybrid_checkpoint, make_hybrid_moe_checkpoint

    path = (make_hybrid_moe_checkpoint if moe else make_hybrid_checkpoint)(tmp_path / "m")
    e = engine(path, dtype="float32", quantization="int8")
    model = e.core.runner.model
    names = {n for n, m in model.named_modules() if isinstance(m, Int8Linear)}
    assert "layers.0.linear_attn.in_proj_qkvz" in names and "layers.0.linear_attn.out_proj" in names
    assert not any("in_proj_ba" in n or n.endswith("mlp.gate") or ".experts" in n for n in names), names
    if moe:
        assert "layers.0.mlp.shared_expert.gate_up_proj" in names
    _, logits = greedy_with_logits(e, 1)
    _, ref_logits = greedy_with_logits(engine(path, dtype="float32"), 1)
    spread = ref_logits[0].max() - ref_logits[0].min()
    assert 0 < (logits[0] - ref_logits[0]).abs().max() < 0.03 * spread  # quantized, and close


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_copy_serves_large_inputs_with_the_same_weights(dtype: torch.dtype) -> None:
    """keep_dense_copy: inputs from the threshold on run the float GEMM over codes * scales (the
    int8 kernel's weights), smaller ones keep the int8 kernel bit for bit."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(40, 100, generator=g) * 0.05, torch.randn(40, generator=g)  # K=100: padded under bf16
    plain = Int8Linear.from_float(w, b, dtype)
    dense = Int8Linear.from_float(w, b, dtype)
    dense.keep_dense_copy(16)
    assert dense.dense is not None and dense.dense.weight.shape == (40, 100) and dense.dense_nbytes > 0
    assert plain.dense_nbytes == 0 and "dense copy from 16 rows" in repr(dense)
    small = torch.randn(15, 100, generator=g).to(dtype)
    assert torch.equal(dense(small), plain(small))  # under the threshold: the int8 kernel
    large = torch.randn(2, 8, 100, generator=g).to(dtype)  # 16 rows: the dense path
    y = dense(large)
    assert y.shape == (2, 8, 40) and y.dtype == dtype
    # The same GEMM over codes * scales (bf16: oneDNN-packed, engine/weights/formats/packed_linear.py).
    assert dense.dense.packed == (dtype == torch.bfloat16 and can_pack(dtype, torch.device("cpu")))
    assert torch.equal(y, F.linear(large, dequantize_int8(dense.weight_codes, dense.scales, dtype), dense.bias))
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    torch.testing.assert_close(y.float(), reference(large, plain), rtol=tol, atol=tol)
    torch.testing.assert_close(y.float(), plain(large).float(), rtol=tol, atol=tol)


def test_quantization_auto_keeps_dense_copies_and_an_explicit_int8_does_not(on_grid: Path) -> None:
    from engine.weights.dtype_policy import AUTO_INT8_DENSE_FROM_ROWS, int8_dense_from_rows

    assert int8_dense_from_rows("auto", INT8) == AUTO_INT8_DENSE_FROM_ROWS
    assert int8_dense_from_rows(INT8, INT8) == 0 and int8_dense_from_rows("auto", None) == 0
    cfg = ModelConfig.from_checkpoint(on_grid)
    method = detect_quantization(on_grid, cfg.quantization, INT8)
    from dataclasses import replace

    model = load_model(on_grid, cfg, torch.bfloat16, torch.device("cpu"), 64, replace(method, int8_dense_from_rows=4))
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert linears and all(m.dense is not None and m.dense_from_rows == 4 for m in linears)
    model = load_model(on_grid, cfg, torch.bfloat16, torch.device("cpu"), 64, method)
    assert all(m.dense is None for m in model.modules() if isinstance(m, Int8Linear))
