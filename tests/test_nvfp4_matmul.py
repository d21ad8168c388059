"""The Triton W4A16 kernel under TRITON_INTERPRET=1 (fp16 dot operands) against the
dequantize-then-matmul reference; its weight layout; tile choice; the CPU dispatch and
NVFP4Linear."""

import importlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
# NOTE: a declared test dependency (missing, the run stops: tests/conftest.py). Imported here, before any
# fixture sets TRITON_INTERPRET: triton keeps state from its first import.
import triton  # noqa: F401

from kernels.nvfp4 import NVFP4Weight, dequantize_nvfp4, fuse_nvfp4, pack_e2m1, quantize_nvfp4, unpack_e2m1
from kernels.nvfp4_matmul import (
    NVFP4Linear,
    nvfp4_linear,
    nvfp4_linear_ref,
    prepare_for_kernel,
    select_backend,
    swizzle_scales_128x4,
)


@pytest.fixture(scope="module")
def triton_cpu() -> Iterator[ModuleType]:
    """kernels.nvfp4_triton with its kernel interpreted. `triton.jit` reads TRITON_INTERPRET
    when the module is (re)imported, so set it, (re)import, and restore both afterwards."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        name = "kernels.nvfp4_triton"
        module = importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    yield module
    importlib.reload(module)  # compiled kernels again for whoever imports it next


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
def test_kernel_layout_round_trips_codes_and_scales(triton_cpu: ModuleType, n: int, k: int) -> None:
    w = make_weight(n, k)
    layout = triton_cpu.pack_kernel_layout(w.packed, w.block_scale, w.row_global_scale())
    k_pad = -(-k // 128) * 128
    assert layout.words.shape == (n, k_pad // 8) and layout.words.dtype == torch.int32
    assert layout.scale_words.shape == (n, k_pad // 64)
    codes, block_scale = triton_cpu.unpack_kernel_layout(layout)
    assert torch.equal(codes, unpack_e2m1(w.packed))
    assert torch.equal(block_scale.view(torch.uint8), w.block_scale.view(torch.uint8))


def test_kernel_layout_is_the_same_when_built_in_row_chunks(triton_cpu: ModuleType,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    w = make_weight(37, 400, seed=1)
    whole = triton_cpu.pack_kernel_layout(w.packed, w.block_scale, w.row_global_scale())
    monkeypatch.setattr(triton_cpu, "_PACK_CHUNK_ELEMENTS", 3 * 512)  # three rows at a time
    chunked = triton_cpu.pack_kernel_layout(w.packed, w.block_scale, w.row_global_scale())
    assert torch.equal(chunked.words, whole.words)


@pytest.mark.parametrize(("k", "code", "word", "shift"), [
    (0, 0x1, 0, 12),  # group 0, j 0: word 0, lane 0, top nibble
    (1, 0x2, 0, 28),  # j 1: the other lane of the same word
    (3 + 16 * 5, 0xA, 9, 24),  # group 5 (second half, q 1), j 3: word 8 + 1, lane 1
    (15 + 16 * 3, 0xF, 7, 16),  # group 3 (q 3), j 15: word 7, lane 1, low nibble
    (128 + 2, 0x9, 17, 12),  # second chunk starts at word 16
])
def test_kernel_layout_places_each_nibble_as_documented(
    triton_cpu: ModuleType, k: int, code: int, word: int, shift: int
) -> None:
    codes = torch.zeros(1, 256, dtype=torch.uint8)
    codes[0, k] = code
    scales = torch.zeros(1, 16, dtype=torch.uint8).view(torch.float8_e4m3fn)
    layout = triton_cpu.pack_kernel_layout(pack_e2m1(codes), scales, torch.ones(1))
    expected = torch.zeros(32, dtype=torch.int64)
    expected[word] = code << shift
    assert (layout.words[0].to(torch.int64) & 0xFFFFFFFF).tolist() == expected.tolist()


# --- the kernel against the reference -----------------------------------------------------


def run_kernel(triton_cpu: ModuleType, x: torch.Tensor, w: NVFP4Weight, bias: torch.Tensor | None = None,
               **config: int) -> torch.Tensor:
    layout = triton_cpu.pack_kernel_layout(w.packed, w.block_scale, w.row_global_scale())
    cfg = triton_cpu.W4A16Config(**{"block_m": 64, "block_n": 64, **config})
    return triton_cpu.w4a16_matmul(x, layout, bias, dot_dtype=torch.float16, config=cfg)


@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize(("n", "k"), [(48, 80), (64, 128), (16, 272)])
def test_gemm_matches_reference(triton_cpu: ModuleType, m: int, n: int, k: int) -> None:
    w, x = make_weight(n, k, seed=m), make_x(m, k, seed=n)
    got = run_kernel(triton_cpu, x, w)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert relative_error(got, reference(x, w)) <= 1e-2


@pytest.mark.parametrize(("m", "split_k"), [(1, 2), (7, 3), (16, 4)])
def test_split_k_matches_reference(triton_cpu: ModuleType, m: int, split_k: int) -> None:
    n, k = 48, 464  # four 128-wide chunks, the last one partial
    w, x = make_weight(n, k, seed=split_k), make_x(m, k, seed=m)
    got = run_kernel(triton_cpu, x, w, block_m=16, split_k=split_k)
    assert relative_error(got, reference(x, w)) <= 1e-2


def test_small_tiles_cover_every_row_and_token(triton_cpu: ModuleType) -> None:
    w, x = make_weight(48, 80, seed=5), make_x(33, 80, seed=6)
    got = run_kernel(triton_cpu, x, w, block_m=16, block_n=16)  # 3 x 3 tiles, ragged M
    assert relative_error(got, reference(x, w)) <= 1e-2


def test_dequantized_operand_is_exact(triton_cpu: ModuleType) -> None:
    """Activations of +-1 on one K position pick out one weight column: exact if the in-register
    decode of codes and scales is exact (any bit slip would be off by >= 2**-4 relative)."""
    n, k = 32, 256
    w = make_weight(n, k, seed=7, std=3.0)
    x = torch.zeros(k, k)
    x[torch.arange(k), torch.arange(k)] = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0)
    got = run_kernel(triton_cpu, x, w, block_m=64)
    want = reference(x, w)
    torch.testing.assert_close(got.double(), want, rtol=2e-7, atol=0.0)


@pytest.mark.parametrize("split_k", [1, 3])
def test_bias_is_added_once(triton_cpu: ModuleType, split_k: int) -> None:
    w, x = make_weight(32, 384, seed=8), make_x(4, 384, seed=9)
    bias = torch.linspace(-2.0, 2.0, 32)
    got = run_kernel(triton_cpu, x, w, bias, block_m=16, split_k=split_k)
    assert relative_error(got, reference(x, w, bias)) <= 1e-2
    assert relative_error(got - bias, reference(x, w)) <= 1e-2


def test_fused_shards_apply_each_shards_global_scale(triton_cpu: ModuleType) -> None:
    shards = [make_weight(32, 128, seed=10, std=1.0), make_weight(16, 128, seed=11, std=1e-3),
              make_weight(16, 128, seed=12, std=0.05)]
    fused = fuse_nvfp4(shards)
    x = make_x(5, 128, seed=13)
    got = run_kernel(triton_cpu, x, fused, block_m=16, block_n=16)
    for (start, stop), shard in zip([(0, 32), (32, 48), (48, 64)], shards):
        assert relative_error(got[:, start:stop], reference(x, shard)) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_output_dtype_follows_activations(triton_cpu: ModuleType, dtype: torch.dtype) -> None:
    w, x = make_weight(16, 128, seed=14), make_x(3, 128, seed=15, dtype=dtype)
    got = run_kernel(triton_cpu, x, w, block_m=16, split_k=2)
    assert got.dtype == dtype
    assert relative_error(got, reference(x.float(), w)) <= 1e-2


def test_default_dot_dtype_is_fp16_on_cpu(triton_cpu: ModuleType) -> None:
    assert triton_cpu.default_dot_dtype(torch.zeros(1, 16, dtype=torch.bfloat16)) == torch.float16


# --- tile choice ---------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "n", "k", "expected"), [
    (1, 4096, 4096, (16, 128, 8)),  # 32 tiles on 132 SMs: split to 256 CTAs
    (16, 6144, 4096, (16, 128, 8)),
    (1, 24576, 4096, (16, 128, 2)),  # 192 tiles: one split fills the GPU twice over
    (1, 4096, 12288, (16, 128, 16)),
    (8, 4096, 256, (16, 128, 1)),  # two K steps: nothing to split
    (64, 4096, 4096, (64, 128, 4)),  # partial sums would outweigh the weights past 4
    (256, 4096, 4096, (128, 128, 1)),
])
def test_choose_config_splits_k_until_sms_are_busy(
    triton_cpu: ModuleType, m: int, n: int, k: int, expected: tuple[int, int, int]
) -> None:
    config = triton_cpu.choose_config(m, n, k, num_sms=132)
    assert (config.block_m, config.block_n, config.split_k) == expected


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
