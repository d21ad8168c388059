"""Weight-only int4 (`--quantization int4`): quantization finds a Q4_1 grid again, the kernel
against a dequantized float reference, padding, fused shards, the dense copy for large inputs,
the engine on a checkpoint whose weights lie on a Q4_1 grid (so int4 changes nothing but the
kernels and bf16's rounding of scales) against the bf16 float run, and the errors."""

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
from engine.host.cpu_kernels import load_cpu_ops
from engine.weights.formats.int4_linear import (
    GROUP_SIZE,
    Int4Linear,
    Int4LinearBuilder,
    check_int4_device,
    dequantize_int4,
    quantize_int4,
    quantize_padded,
)
from engine.weights.formats.int8_linear import Int8Linear
from engine.weights.formats.nvfp4 import INT4, detect_quantization, is_quantizable
from kernels.cpu_int4 import int4_gemv_native
from scheduler.request import SamplingParams
from tests.engine.test_engine_correctness import capture_logits
from tests.factories import make_checkpoint

PROMPT = [5, 17, 42, 99, 7, 300, 12, 64, 1, 250]


def q4_1_grid(n: int, k: int, seed: int) -> torch.Tensor:
    """[n, k] float32 weights as GGUF's Q4_1 stores them: d * q + m per block of 32 along each row,
    q in 0..15 with both ends used (Q4_1 sets d = (max - min) / 15 and m = min); d and m on a grid
    bf16 holds exactly, so int4's bf16 scales lose nothing."""
    g = torch.Generator().manual_seed(seed)
    blocks = k // GROUP_SIZE
    d = torch.exp2(torch.randint(-9, -5, (n, blocks, 1), generator=g).float())
    m = -8 * d + torch.randint(-4, 5, (n, blocks, 1), generator=g).float() * d
    q = torch.randint(0, 16, (n, blocks, GROUP_SIZE), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    return (d * q + m).reshape(n, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_finds_a_q4_1_grid_again_exactly(dtype: torch.dtype) -> None:
    w = q4_1_grid(48, 96, seed=1)
    codes, sz = quantize_int4(w, dtype)
    assert codes.dtype == torch.uint8 and int(codes.max()) == 15 and int(codes.min()) == 0
    assert sz.shape == (96 // GROUP_SIZE, 48, 2) and sz.dtype == dtype
    assert torch.equal(dequantize_int4(codes, sz), w)


def test_quantize_error_is_half_a_step_and_constant_groups_are_exact() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=g) * torch.logspace(-3, 1, 16)[:, None]
    w[4, :32] = 0.7  # a constant group
    codes, sz = quantize_int4(w, torch.float32)
    err = (dequantize_int4(codes, sz) - w).abs().reshape(16, 2, 32).amax(-1)  # [N, groups]
    step = sz[..., 0].t()  # [N, groups]
    assert torch.all(err <= 0.5 * step * (1 + 1e-5) + 1e-7)
    assert torch.allclose(dequantize_int4(codes, sz)[4, :32], torch.full((32,), 0.7))


@pytest.mark.parametrize("shape", [(1, 64, 96), (7, 576, 960), (3, 100, 40), (32, 48, 16)])  # K=100, 48: padded
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("own_kernel", [False, True], ids=["torch-kernel", "our-op"])
def test_int4_linear_equals_the_dequantized_float_reference(
    shape: tuple[int, int, int], bias: bool, own_kernel: bool
) -> None:
    if own_kernel:
        assert load_cpu_ops() is None  # kernels/cpu_int4.cpp
    tokens, k, n = shape
    g = torch.Generator().manual_seed(tokens * k + n)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    linear = Int4Linear.from_float(w, b, own_kernel=own_kernel)
    assert linear.own_kernel == own_kernel
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16)
    y = linear(x)
    assert y.dtype == torch.bfloat16 and y.shape == (tokens, n) and linear.in_features == k
    codes, sz = quantize_padded(w)
    ref = F.linear(
        F.pad(x.float(), (0, codes.shape[1] - k)),
        dequantize_int4(codes, sz),
        None if b is None else b.to(torch.bfloat16).float(),
    )
    # float32 accumulation, then the output (and the bias add) rounded to bf16: a few ulps
    torch.testing.assert_close(y.float(), ref, rtol=2**-6, atol=2**-6)


def test_int4_linear_takes_any_leading_shape_and_strided_input() -> None:
    linear = Int4Linear.from_float(torch.randn(48, 64), None)
    x = torch.randn(2, 3, 128).to(torch.bfloat16)[..., ::2]  # [2, 3, 64], stride 2 in the last dim
    assert torch.equal(linear(x), linear(x.contiguous().view(6, 64)).view(2, 3, 48))


def test_the_dense_copy_serves_large_inputs_with_the_same_weights() -> None:
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(40, 100, generator=g) * 0.05, torch.randn(40, generator=g)
    codes, sz = quantize_padded(w)
    plain = Int4Linear(codes, sz, b.to(torch.bfloat16), in_features=100)
    dense = Int4Linear(codes, sz, b.to(torch.bfloat16), in_features=100, dense_from_rows=8)
    assert dense.dense is not None and plain.dense is None and dense.dense_nbytes > 0 and plain.dense_nbytes == 0
    assert dense.packed_nbytes == dense.dense_nbytes and "dense copy from 8 rows" in repr(dense)
    small = torch.randn(7, 100, generator=g).to(torch.bfloat16)
    assert torch.equal(dense(small), plain(small))  # under the threshold: the int4 kernel
    large = torch.randn(2, 4, 100, generator=g).to(torch.bfloat16)  # 8 rows: the GEMM
    weight = dequantize_int4(codes, sz)[:, :100].to(torch.bfloat16)
    assert torch.equal(dense(large), F.linear(large, weight, dense.bias))
    torch.testing.assert_close(dense(large).float(), plain(large).float(), rtol=2**-6, atol=2**-6)


def test_builder_fuses_shards_arriving_in_any_order_exactly() -> None:
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(n, 40, generator=g) for n in (16, 8, 8)]  # K=40: padded to 64
    builder = Int4LinearBuilder(
        ["q", "k", "v"], [16, 8, 8], 40, torch.zeros(32, dtype=torch.bfloat16), torch.bfloat16, torch.device("cpu")
    )
    for shard in (2, 0, 1):
        builder.add(shard, "weight", parts[shard])
        builder.add(shard, "bias", torch.full((parts[shard].shape[0],), float(shard)))
    fused = builder.build()
    whole = Int4Linear.from_float(torch.cat(parts), None)  # row-wise groups: fusing is exact
    assert torch.equal(fused.packed, whole.packed) and torch.equal(fused.scales_and_zeros, whole.scales_and_zeros)
    assert fused.bias is not None and fused.bias.tolist() == [0.0] * 16 + [1.0] * 8 + [2.0] * 8
    with pytest.raises(ConfigError, match="'q.weight_scale' is a quantization tensor"):
        builder.add(0, "weight_scale", torch.ones(16))
    empty = Int4LinearBuilder(["a", "b"], [8, 8], 32, None, torch.bfloat16, torch.device("cpu"))
    empty.add(0, "weight", torch.randn(8, 32))
    with pytest.raises(ConfigError, match="missing tensor for 'b.weight'"):
        empty.build()


def snap_to_q4_1_grid(path: Path) -> None:
    """Rewrite the checkpoint's quantizable linears onto a Q4_1 grid (as the GGUF-converted SmolLM2's
    are), and the tied embedding onto an int8-per-row grid."""
    tensors = load_file(str(path / "model.safetensors"))
    for i, (name, w) in enumerate(sorted(tensors.items())):
        module = name.removesuffix(".weight")
        if is_quantizable(module):
            tensors[name] = q4_1_grid(*w.shape, seed=i) * (w.abs().max() / 0.3)  # a power-of-two-ish rescale
        elif module == "model.embed_tokens":
            scale = torch.exp2(torch.ceil(torch.log2(w.abs().amax(1) / 127)))
            codes = torch.round(w / scale[:, None]).clamp(-127, 127)
            codes[:, 0] = 127
            tensors[name] = (codes * scale[:, None]).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def on_grid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("q4grid"), "llama", tie=True, init_std=0.1)
    snap_to_q4_1_grid(path)
    return path


def engine(path: Path, **overrides: Any) -> OfflineEngine:
    return OfflineEngine.from_config(EngineConfig(model=str(path), kv_cache_memory="4MiB", **overrides))


def greedy_with_logits(e: OfflineEngine, num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    seen = capture_logits(e)
    [result] = e.generate([PROMPT], SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    return result.token_ids[0], next(iter(seen.values()))


def test_int4_tracks_the_bf16_float_run_on_q4_1_grid_weights(on_grid: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Same weights (int4 finds the grid again), the lm_head int8: greedy tokens agree with the bf16
    float run, and the first logits move by little next to their spread."""
    with caplog.at_level(logging.INFO, logger="fp4serve"):
        e = engine(on_grid, quantization="int4")
    model = e.core.runner.model
    assert isinstance(model.layers[0].self_attn.qkv_proj, Int4Linear) and isinstance(model.lm_head, Int8Linear)
    assert model.lm_head.cpu_gemv  # the compiled int8 op (kernels/cpu_gemv.cpp), its input Q8_0 with VNNI
    assert any(
        "int4: 9 linears quantized at load" in r.getMessage() and "lm_head int8" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
    assert all(m.dense is None for m in model.modules() if isinstance(m, Int4Linear))  # explicit: no copies
    # the engine loads the CPU ops before the weights: the int4 linears take our op where it has its fast loop
    native, int4 = int4_gemv_native(), [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert all(m.own_kernel == native for m in int4)
    kernel_line = f"{len(int4) if native else 0} int4 linears run our AVX512-BF16 op"
    assert any(kernel_line in r.getMessage() for r in caplog.records)
    ours, logits = greedy_with_logits(e, 8)
    theirs, ref_logits = greedy_with_logits(engine(on_grid, dtype="bfloat16", quantization="none"), 8)
    assert ours[:4] == theirs[:4]
    spread = ref_logits[0].max() - ref_logits[0].min()
    assert (logits[0] - ref_logits[0]).abs().max() < 0.03 * spread


def test_int4_with_dense_copies_decodes_small_and_large_batches_alike(
    on_grid: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto's layout (dense copies, from 4 rows here): a request's greedy tokens do not depend on
    whether its steps ran the int4 kernel (alone) or the GEMM (in a batch of 6)."""
    monkeypatch.setattr("engine.model_runner.int8_dense_from_rows", lambda requested, scheme: 4)
    e = engine(on_grid, quantization="int4")
    linears = [m for m in e.core.runner.model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    assert linears and all(m.dense is not None and m.dense_from_rows == 4 for m in linears)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = e.generate([PROMPT], params)[0].token_ids[0]
    together = e.generate([PROMPT] * 6, params)
    assert all(r.token_ids[0] == alone for r in together)


def test_int4_needs_a_cpu_bf16_activations_and_a_float_checkpoint(on_grid: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--quantization int4: CPU only"):
        check_int4_device(torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ConfigError, match="--quantization int4 runs bfloat16 activations; --dtype float32"):
        engine(on_grid, quantization="int4", dtype="float32")
    method = detect_quantization(on_grid, None, "int4")
    assert method is not None and method.scheme == INT4 and "group of 32" in method.describe()
    nvfp4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    with pytest.raises(ConfigError, match="int4: the checkpoint is already quantized .config.json"):
        detect_quantization(tmp_path, nvfp4, "int4")


def test_the_flag_reaches_the_engine_config_and_the_help() -> None:
    parser = build_parser()
    assert server_config(parser.parse_args(["serve", "--quantization", "int4"])).engine.quantization == "int4"
    serve = next(
        a
        for a in parser._subparsers._group_actions[0].choices.values()  # type: ignore[union-attr]
        if any("--quantization" in o.option_strings for o in a._actions)
    )
    help_text = " ".join(serve.format_help().split())
    assert "{auto,none,nvfp4,int8,int4}" in help_text and "int4 (CPU only" in help_text


def test_a_built_dense_copy_holds_the_checkpoint_weights_not_the_int4_ones() -> None:
    """The builder's dense copy is made from the float weights it quantized: large inputs multiply
    those (as `--dtype bfloat16` would), small ones the int4 codes."""
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(32, 64, generator=g) * 0.05, torch.randn(16, 64, generator=g) * 0.05
    builder = Int4LinearBuilder(["q", "k"], [32, 16], 64, None, torch.bfloat16, torch.device("cpu"), 8)
    builder.add(1, "weight", k)
    builder.add(0, "weight", q)
    linear = builder.build()
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    fused = torch.cat([q, k]).to(torch.bfloat16)
    dense = linear(x)
    assert torch.equal(dense, F.linear(x, fused))
    int4 = linear(x[:7])
    assert not torch.equal(int4, dense[:7])  # the codes' rounding shows under the threshold
    codes, sz = zip(quantize_padded(q), quantize_padded(k))
    grid = dequantize_int4(torch.cat(codes), torch.cat(sz, dim=1)).to(torch.bfloat16)  # the int4 weights
    torch.testing.assert_close(int4.float(), F.linear(x[:7], grid).float(), rtol=2**-6, atol=2**-6)
