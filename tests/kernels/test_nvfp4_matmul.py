"""The Triton NVFP4 kernels under TRITON_INTERPRET=1 (fp16 dot operands) against the
dequantize-then-matmul reference: the W4A16 matmul (every tile shape, split-K reduced in the
kernel), the dequantize kernel, their weight layout, the tile/split heuristic on real shapes, the
per-M dispatch and NVFP4Linear."""

import dataclasses
import importlib
import logging
import os
import sys
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import pytest
import torch

# NOTE: a declared test dependency (missing, the run stops: tests/conftest.py). Imported here, before any
# fixture sets TRITON_INTERPRET: triton keeps state from its first import.
import triton  # noqa: F401

from bench.kernels import QWEN3_8B_SHAPES, QWEN36_27B_SHAPES
from kernels.nvfp4 import NVFP4Weight, dequantize_nvfp4, fuse_nvfp4, pack_e2m1, quantize_nvfp4, unpack_e2m1
from kernels.nvfp4_matmul import (
    DEQUANT_MIN_M,
    NVFP4Linear,
    describe_dispatch,
    log_dispatch_once,
    matmul_path,
    nvfp4_linear,
    nvfp4_linear_prepared,
    nvfp4_linear_ref,
    prepare_for_kernel,
    select_backend,
    swizzle_scales_128x4,
)

TRITON_MODULES = ("kernels.nvfp4_triton", "kernels.nvfp4_w4a16", "kernels.nvfp4_dequant")


@pytest.fixture(scope="module")
def triton_cpu() -> Iterator[SimpleNamespace]:
    """The Triton NVFP4 modules with their kernels interpreted, as .layout (nvfp4_triton),
    .w4a16 and .dequant. `triton.jit` reads TRITON_INTERPRET when a module is (re)imported, so
    set it, (re)import them in dependency order, and restore both afterwards."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    modules: list[ModuleType] = []
    try:
        for name in TRITON_MODULES:
            modules.append(
                importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
            )
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    yield SimpleNamespace(layout=modules[0], w4a16=modules[1], dequant=modules[2])
    for module in modules:
        importlib.reload(module)  # compiled kernels again for whoever imports them next


def make_weight(n: int, k: int, seed: int = 0, std: float = 0.05) -> NVFP4Weight:
    g = torch.Generator().manual_seed(seed)
    return quantize_nvfp4(torch.randn(n, k, generator=g) * std)


def make_x(m: int, k: int, seed: int = 100, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def reference(x: torch.Tensor, w: NVFP4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return nvfp4_linear_ref(x.double(), w, None if bias is None else bias.double())


# --- the kernel's weight layout -----------------------------------------------------------


@pytest.mark.parametrize(("n", "k"), [(3, 16), (48, 80), (5, 128), (7, 400)])
def test_kernel_layout_round_trips_codes_and_scales(triton_cpu: SimpleNamespace, n: int, k: int) -> None:
    w = make_weight(n, k)
    layout = triton_cpu.layout.pack_kernel_layout(w.packed, w.block_scale, w.row_global_scale())
    k_pad = -(-k // 128) * 128
    assert layout.words.shape == (n, k_pad // 8) and layout.words.dtype == torch.int32
    assert layout.scale_words.shape == (n, k_pad // 64)
    codes, block_scale = triton_cpu.layout.unpack_kernel_layout(layout)
    assert torch.equal(codes, unpack_e2m1(w.packed))
    assert torch.equal(block_scale.view(torch.uint8), w.block_scale.view(torch.uint8))


def test_kernel_layout_is_the_same_when_built_in_row_chunks(
    triton_cpu: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = make_weight(37, 400, seed=1)
    whole = triton_cpu.layout.pack_kernel_layout(w.packed, w.block_scale, w.row_global_scale())
    monkeypatch.setattr(triton_cpu.layout, "_PACK_CHUNK_ELEMENTS", 3 * 512)  # three rows at a time
    chunked = triton_cpu.layout.pack_kernel_layout(w.packed, w.block_scale, w.row_global_scale())
    assert torch.equal(chunked.words, whole.words)


@pytest.mark.parametrize(
    ("k", "code", "word", "shift"),
    [
        (0, 0x1, 0, 12),  # group 0, j 0: word 0, lane 0, top nibble
        (1, 0x2, 0, 28),  # j 1: the other lane of the same word
        (3 + 16 * 5, 0xA, 9, 24),  # group 5 (second half, q 1), j 3: word 8 + 1, lane 1
        (15 + 16 * 3, 0xF, 7, 16),  # group 3 (q 3), j 15: word 7, lane 1, low nibble
        (128 + 2, 0x9, 17, 12),  # second chunk starts at word 16
    ],
)
def test_kernel_layout_places_each_nibble_as_documented(
    triton_cpu: SimpleNamespace, k: int, code: int, word: int, shift: int
) -> None:
    codes = torch.zeros(1, 256, dtype=torch.uint8)
    codes[0, k] = code
    scales = torch.zeros(1, 16, dtype=torch.uint8).view(torch.float8_e4m3fn)
    layout = triton_cpu.layout.pack_kernel_layout(pack_e2m1(codes), scales, torch.ones(1))
    expected = torch.zeros(32, dtype=torch.int64)
    expected[word] = code << shift
    assert (layout.words[0].to(torch.int64) & 0xFFFFFFFF).tolist() == expected.tolist()


def test_layout_carries_zeroed_split_k_counters(triton_cpu: SimpleNamespace) -> None:
    w = make_weight(37, 128, seed=2)
    layout = triton_cpu.layout.pack_kernel_layout(w.packed, w.block_scale, w.row_global_scale())
    assert layout.tile_locks.shape == (3,) and layout.tile_locks.dtype == torch.int32
    assert not layout.tile_locks.any()
    assert layout.nbytes == layout.words.nbytes + layout.scale_words.nbytes + 37 * 4  # counters are not weights


# --- the W4A16 kernel against the reference ------------------------------------------------
#
# Tolerance, from the arithmetic rather than a guess: x is rounded to fp16 first (the dot dtype
# here), so both dot operands are exact (weights e2m1 * sf * 2**-14 are exact in fp16) and so is
# each fp16 x fp16 product in fp32. What remains is fp32 rounding: at most K - 1 additions per
# slice, one per extra slice, the epilogue's multiply and divide, the bias add, and the
# reference's own division by S, each <= 2**-24 relative to the sum of |terms|.


def fp16_exact(m: int, k: int, seed: int) -> torch.Tensor:
    return make_x(m, k, seed=seed).half().float()


def assert_within_fp32_rounding(
    got: torch.Tensor, x: torch.Tensor, w: NVFP4Weight, bias: torch.Tensor | None = None, slices: int = 1
) -> None:
    want = reference(x, w, bias)
    magnitude = x.double().abs() @ dequantize_nvfp4(w, torch.float64).abs().T  # [M, N] sum of |terms|
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    k = x.shape[1]
    bound = (k + slices + 4) * 2.0**-24 * magnitude
    if got.dtype != torch.float32:
        # The final cast: half an ulp, but a whole one here (the interpreter's bf16 cast can be one off).
        bound = bound + torch.finfo(got.dtype).eps * want.abs()
    excess = (got.double() - want).abs() - bound
    assert excess.max().item() <= 0.0, f"worst excess {excess.max().item():.3g}"


def run_kernel(
    triton_cpu: SimpleNamespace, x: torch.Tensor, w: NVFP4Weight, bias: torch.Tensor | None = None, **config: int | bool
) -> torch.Tensor:
    layout = triton_cpu.layout.pack_kernel_layout(w.packed, w.block_scale, w.row_global_scale())
    cfg = triton_cpu.w4a16.W4A16Config(**{"block_m": 16, "block_n": 16, **config}) if config else None
    got = triton_cpu.w4a16.w4a16_matmul(x, layout, bias, dot_dtype=torch.float16, config=cfg)
    assert not layout.tile_locks.any(), "split-K counters must be back at zero after the launch"
    return got


@pytest.mark.parametrize("m", [*range(1, 18), 64, 130])
def test_chosen_tiles_match_reference_for_every_decode_m(triton_cpu: SimpleNamespace, m: int) -> None:
    """Odd N (a ragged row tile) and K (a partial 128-chunk); the CPU heuristic splits K."""
    n, k = 37, 464
    w, x = make_weight(n, k, seed=m), fp16_exact(m, k, seed=m + 50)
    got = run_kernel(triton_cpu, x, w)
    assert got.shape == (m, n) and got.dtype == torch.float32
    slices = triton_cpu.w4a16.choose_config(m, n, k, num_sms=4).split_k
    assert_within_fp32_rounding(got, x, w, slices=slices)


@pytest.mark.parametrize(
    ("block_m", "block_n", "split_k", "halves"),
    [
        (16, 16, 1, 2),
        (16, 32, 2, 2),
        (16, 64, 3, 4),
        (32, 16, 4, 2),
        (64, 16, 2, 8),
        (16, 16, 9, 2),
    ],
)
@pytest.mark.parametrize(("n", "k"), [(48, 80), (19, 400), (64, 512)])
@pytest.mark.parametrize("lanes", [False, True], ids=["joined", "lanes"])
def test_every_tile_shape_and_split_matches_reference(
    triton_cpu: SimpleNamespace, block_m: int, block_n: int, split_k: int, halves: int, n: int, k: int, lanes: bool
) -> None:
    w, x = make_weight(n, k, seed=split_k), fp16_exact(33, k, seed=n)
    got = run_kernel(triton_cpu, x, w, block_m=block_m, block_n=block_n, split_k=split_k, halves=halves, lanes=lanes)
    assert_within_fp32_rounding(got, x, w, slices=split_k)


def test_split_k_is_reproducible_and_close_to_one_slice(triton_cpu: SimpleNamespace) -> None:
    w, x = make_weight(32, 512, seed=3), fp16_exact(5, 512, seed=4)
    first = run_kernel(triton_cpu, x, w, split_k=4, halves=2)
    assert torch.equal(run_kernel(triton_cpu, x, w, split_k=4, halves=2), first)  # fixed-order sum
    assert_within_fp32_rounding(run_kernel(triton_cpu, x, w, split_k=1, halves=2), x, w)


@pytest.mark.parametrize("locks", [torch.zeros(1, dtype=torch.int32), None], ids=["too-few", "none"])
def test_too_few_counters_fall_back_to_one_slice(triton_cpu: SimpleNamespace, locks: torch.Tensor | None) -> None:
    w, x = make_weight(48, 256, seed=5), fp16_exact(3, 256, seed=6)
    layout = triton_cpu.layout.pack_kernel_layout(w.packed, w.block_scale, w.row_global_scale())
    layout = dataclasses.replace(layout, tile_locks=locks)  # 3 tiles: 1 counter or none
    cfg = triton_cpu.w4a16.W4A16Config(16, 16, split_k=2, halves=2)
    got = triton_cpu.w4a16.w4a16_matmul(x, layout, dot_dtype=torch.float16, config=cfg)
    assert_within_fp32_rounding(got, x, w)
    assert locks is None or not locks.any()


@pytest.mark.parametrize("lanes", [False, True], ids=["joined", "lanes"])
def test_dequantized_operand_is_exact(triton_cpu: SimpleNamespace, lanes: bool) -> None:
    """Activations of +-1 on one K position pick out one weight column: exact if the in-register
    decode of codes and scales is exact (any bit slip would be off by >= 2**-4 relative)."""
    n, k = 32, 256
    w = make_weight(n, k, seed=7, std=3.0)
    x = torch.zeros(k, k)
    x[torch.arange(k), torch.arange(k)] = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0)
    got = run_kernel(triton_cpu, x, w, block_m=64, block_n=32, halves=4, lanes=lanes)
    want = reference(x, w)
    torch.testing.assert_close(got.double(), want, rtol=2e-7, atol=0.0)


@pytest.mark.parametrize("split_k", [1, 3])
def test_bias_is_added_once(triton_cpu: SimpleNamespace, split_k: int) -> None:
    w, x = make_weight(32, 384, seed=8), fp16_exact(4, 384, seed=9)
    bias = torch.linspace(-2.0, 2.0, 32)
    got = run_kernel(triton_cpu, x, w, bias, split_k=split_k, halves=2, lanes=split_k > 1)
    assert_within_fp32_rounding(got, x, w, bias, slices=split_k)


def test_fused_shards_apply_each_shards_global_scale(triton_cpu: SimpleNamespace) -> None:
    shards = [
        make_weight(32, 256, seed=10, std=1.0),
        make_weight(16, 256, seed=11, std=1e-3),
        make_weight(16, 256, seed=12, std=0.05),
    ]
    x = fp16_exact(5, 256, seed=13)
    got = run_kernel(triton_cpu, x, fuse_nvfp4(shards), split_k=2, halves=2)
    for (start, stop), shard in zip([(0, 32), (32, 48), (48, 64)], shards):
        assert_within_fp32_rounding(got[:, start:stop], x, shard, slices=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_output_dtype_follows_activations(triton_cpu: SimpleNamespace, dtype: torch.dtype) -> None:
    w, x = make_weight(16, 256, seed=14), fp16_exact(3, 256, seed=15).to(dtype)
    got = run_kernel(triton_cpu, x, w, split_k=2, halves=2)
    assert got.dtype == dtype
    assert_within_fp32_rounding(got, x.float(), w, slices=2)


def test_default_dot_dtype_is_fp16_on_cpu(triton_cpu: SimpleNamespace) -> None:
    assert triton_cpu.layout.default_dot_dtype(torch.zeros(1, 16, dtype=torch.bfloat16)) == torch.float16


# --- the dequantize kernel ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(37, 464), (64, 256), (3, 16)])
def test_dequantized_layout_equals_the_reference_bit_for_bit(
    triton_cpu: SimpleNamespace, dtype: torch.dtype, n: int, k: int
) -> None:
    """bf16 is checked on the GPU: the interpreter's bf16 cast rounds differently from torch's."""
    shards = [make_weight(n, k, seed=16, std=2.0), make_weight(n, k, seed=17, std=1e-3)]
    w = fuse_nvfp4(shards)
    layout = triton_cpu.layout.pack_kernel_layout(w.packed, w.block_scale, w.row_global_scale())
    got = triton_cpu.dequant.dequantize_layout(layout, dtype)
    assert got.shape == (2 * n, k) and torch.equal(got, dequantize_nvfp4(w, dtype))


# --- tile choice, on the real shapes -------------------------------------------------------

REAL_SHAPES = sorted({*QWEN3_8B_SHAPES.values(), *QWEN36_27B_SHAPES.values()})


@pytest.mark.parametrize(("n", "k"), REAL_SHAPES)
@pytest.mark.parametrize("num_sms", [132, 78])  # H100/H200 SXM, H20
def test_decode_launches_keep_every_sm_busy(triton_cpu: SimpleNamespace, n: int, k: int, num_sms: int) -> None:
    w4a16 = triton_cpu.w4a16
    for m in (1, 8, 16):
        config = w4a16.choose_config(m, n, k, num_sms)
        assert w4a16.num_ctas(m, n, k, config) >= 2 * num_sms, (m, config)
        assert (config.block_m, config.block_n, config.block_k) == (16, 64, 256)
        steps_per_slice = w4a16.effective_split(k, config.block_k, config.split_k)[1] // config.block_k
        assert steps_per_slice >= 2  # something for the pipeline to overlap
        assert config.split_k == w4a16.effective_split(k, config.block_k, config.split_k)[0]  # no empty slice


@pytest.mark.parametrize(
    ("m", "n", "k", "expected"),
    [
        (1, 4096, 4096, (16, 64, 6)),  # 64 row tiles; 4 or 5 slices of 16 steps are 256 CTAs, < 2 x 132
        (1, 24576, 4096, (16, 64, 1)),  # 384 tiles already fill 132 SMs twice
        (1, 4096, 12288, (16, 64, 5)),
        (64, 4096, 4096, (64, 64, 4)),  # partial sums would outweigh the weights past 4 slices
        (256, 4096, 4096, (128, 64, 1)),  # 32 x 2 tiles of 128 x 128 would leave half the SMs idle
        (256, 4096, 12288, (128, 64, 3)),
        (256, 24576, 4096, (128, 128, 1)),
        (8, 4096, 256, (16, 64, 1)),  # one K step: nothing to split
    ],
)
def test_choose_config_splits_k_until_sms_are_busy(
    triton_cpu: SimpleNamespace, m: int, n: int, k: int, expected: tuple[int, int, int]
) -> None:
    config = triton_cpu.w4a16.choose_config(m, n, k, num_sms=132)
    assert (config.block_m, config.block_n, config.split_k) == expected
    assert (config.num_warps, config.lanes) == ((8 if m > 64 else 4), False)
    assert config.num_stages == (4 if m <= 16 else 3)


# --- the per-M dispatch on the Triton operand -----------------------------------------------


def test_matmul_path_switches_to_dequantize_at_prefill_sizes() -> None:
    assert DEQUANT_MIN_M == 128
    assert [matmul_path(m) for m in (1, 16, 64, 127, 128, 4096)] == ["w4a16"] * 4 + ["dequant"] * 2
    assert matmul_path(64, dequant_min_m=64) == "dequant"
    line = describe_dispatch(4096, 4096, num_sms=132)
    assert "M=1: m16 n64 k256" in line and "M=256: dequantize + cuBLAS" in line


def test_the_per_m_choice_is_logged_once_per_shape(caplog: pytest.LogCaptureFixture) -> None:
    log_dispatch_once.cache_clear()
    with caplog.at_level(logging.INFO, logger="fp4serve.kernels"):
        for n, k in [(4096, 4096), (4096, 4096), (6144, 4096)]:
            log_dispatch_once(torch.device("cpu"), n, k)
    lines = [r.getMessage() for r in caplog.records if r.name == "fp4serve.kernels"]
    assert len(lines) == 2 and "[4096x4096]" in lines[0] and "[6144x4096]" in lines[1]
    assert "M=16: m16 n64 k256" in lines[0] and "M=128: dequantize + cuBLAS" in lines[0]


@pytest.mark.parametrize("m", [5, 130])  # the kernel, then dequantize + matmul
def test_prepared_layout_dispatch_matches_reference(triton_cpu: SimpleNamespace, m: int) -> None:
    w, x = make_weight(37, 464, seed=18), fp16_exact(m, 464, seed=19)
    bias = torch.linspace(-1.0, 1.0, 37)
    layout = triton_cpu.layout.pack_kernel_layout(w.packed, w.block_scale, w.row_global_scale())
    got = nvfp4_linear_prepared(x, layout, bias)
    assert got.shape == (m, 37) and got.dtype == torch.float32
    assert_within_fp32_rounding(got, x, w, bias, slices=triton_cpu.w4a16.choose_config(m, 37, 464, 4).split_k)


# --- dispatch and the module on CPU --------------------------------------------------------


def test_cpu_dispatch_is_the_reference() -> None:
    w, x = make_weight(48, 80, seed=16), make_x(3, 80, seed=17, dtype=torch.bfloat16)
    bias = torch.randn(48)
    assert select_backend(torch.device("cpu")) == "torch"
    got = nvfp4_linear(x, w, bias)
    assert got.dtype == torch.bfloat16
    want = torch.nn.functional.linear(x, dequantize_nvfp4(w, torch.bfloat16), bias.to(torch.bfloat16))
    assert torch.equal(got, want)


def test_nvfp4_linear_module_keeps_only_packed_weights() -> None:
    w = make_weight(64, 128, seed=18)
    layer = NVFP4Linear(w, bias=torch.zeros(64))
    assert layer.backend == "torch" and prepare_for_kernel(w) is w
    assert layer.weight_nbytes == w.nbytes == 64 * 128 * 9 // 16 + 4
    assert not any(t.dtype.is_floating_point and t.numel() >= 64 * 128 for t in layer.state_dict().values())
    x = make_x(6, 128, seed=19).reshape(2, 3, 128)
    out = layer(x)
    assert out.shape == (2, 3, 64)
    assert torch.equal(out.reshape(6, 64), nvfp4_linear_ref(x.reshape(6, 128), w, torch.zeros(64)))


def test_casting_the_module_leaves_fp8_scales_alone() -> None:
    layer = NVFP4Linear(make_weight(16, 32, seed=20), bias=torch.ones(16)).to(torch.bfloat16)
    assert layer.bias.dtype == torch.bfloat16
    assert layer.operand.block_scale.dtype == torch.float8_e4m3fn
    assert layer.operand.global_scale.dtype == torch.float32


def test_swizzled_scales_follow_the_128x4_formula() -> None:
    n, groups = 200, 6
    bits = torch.randint(0, 0x7F, (n, groups), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    swizzled = swizzle_scales_128x4(bits.view(torch.float8_e4m3fn)).view(torch.uint8)
    column_tiles = -(-groups // 4)
    assert swizzled.numel() == 256 * column_tiles * 4
    for row in range(n):
        for g in range(groups):
            offset = ((row // 128) * column_tiles + g // 4) * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + g % 4
            assert swizzled[offset] == bits[row, g]
    assert int(swizzled.to(torch.int64).sum()) == int(bits.to(torch.int64).sum())  # padding is zero
