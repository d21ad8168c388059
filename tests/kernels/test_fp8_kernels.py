"""The block-FP8 W8A8 kernels (kernels/fp8_triton.py, kernels/fused_moe_fp8_triton.py) under
TRITON_INTERPRET=1 against their torch references, the references against the definition (exact
fp8 products, per-group scales), the in-register e4m3 rounding against torch's cast, and the
fusing of shards and experts. These kernels have never run on a GPU (docs/gpu.md)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
import triton  # noqa: F401  (the interpreted kernels need it)

from kernels.fp8_block import (
    FP8_DTYPE,
    Fp8BlockWeight,
    dequantize_block_fp8,
    fuse_fp8,
    quantize_activation_groups,
    quantize_block_fp8,
    w8a8_block_matmul_ref,
)
from kernels.fp8_dispatch import Fp8Experts, Fp8Linear
from kernels.fused_moe_fp8 import Fp8ExpertWeights, fused_experts_fp8_ref

_KERNEL_MODULES = ("kernels.fp8_triton", "kernels.fused_moe_triton", "kernels.fused_moe_fp8_triton")


@pytest.fixture(scope="module")
def interpreted() -> Iterator[dict[str, ModuleType]]:
    """The FP8 kernel modules with their kernels interpreted (see tests/kernels/test_nvfp4_matmul.py)."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        modules = {
            name: importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
            for name in _KERNEL_MODULES
        }
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    yield modules
    for name in _KERNEL_MODULES:
        importlib.reload(sys.modules[name])  # compiled kernels again for whoever imports them next


def weight(n: int, k: int, seed: int = 0, block_n: int = 128) -> Fp8BlockWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return Fp8BlockWeight(*quantize_block_fp8(w, (block_n, 128)), block_n, 128)


def definition(x: torch.Tensor, w: Fp8BlockWeight) -> torch.Tensor:
    """W8A8 written out in float64, one (token, group) at a time."""
    codes, scales = quantize_activation_groups(x, w.block_k)
    wf = w.codes.double()
    out = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for g in range(scales.shape[1]):
        cols = slice(g * 128, (g + 1) * 128)
        for n in range(w.shape[0]):
            out[:, n] += (
                (codes[:, cols].double() @ wf[n, cols]) * scales[:, g].double() * float(w.scale[n // w.block_n, g])
            )
    return out


def test_reference_is_the_w8a8_definition() -> None:
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    w = weight(40, 300)
    assert torch.allclose(w8a8_block_matmul_ref(x, w).double(), definition(x, w), rtol=1e-6, atol=1e-6)


def test_activation_groups_quantize_like_deepseeks_act_quant() -> None:
    x = torch.randn(4, 200)
    x[1, :128] = 0.0  # an all-zero group: zero codes, not NaN
    codes, scales = quantize_activation_groups(x, 128)
    assert codes.dtype == FP8_DTYPE and scales.shape == (4, 2)
    assert torch.equal(scales[0, 0], x[0, :128].abs().max() / 448.0)
    assert codes[1, :128].float().abs().sum() == 0 and torch.isfinite(codes.float()).all()
    assert codes.float().abs().max() == 448.0  # each group's largest value maps to the top code


@pytest.mark.parametrize("m,n,k,block_n", [(1, 200, 300, 128), (5, 64, 256, 1), (17, 130, 128, 128), (40, 96, 200, 1)])
def test_gemm_matches_reference(interpreted: dict[str, ModuleType], m: int, n: int, k: int, block_n: int) -> None:
    """Decode and prefill rows, a K tail (partial last group), rows past a 128-block, per-row
    scales (an unaligned fuse), with a bias."""
    w = weight(n, k, seed=m, block_n=block_n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(n)
    got = interpreted["kernels.fp8_triton"].w8a8_block_matmul(x, w, bias)
    want = w8a8_block_matmul_ref(x, w, bias)
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gemm_output_follows_activation_dtype(interpreted: dict[str, ModuleType]) -> None:
    w = weight(64, 128)
    x = torch.randn(3, 128).to(torch.bfloat16)
    got = interpreted["kernels.fp8_triton"].w8a8_block_matmul(x, w)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), w8a8_block_matmul_ref(x, w).float(), rtol=1e-2, atol=1e-2)


def test_in_register_rounding_is_torchs_e4m3_cast(interpreted: dict[str, ModuleType]) -> None:
    """Every e4m3 value, every midpoint between two (ties to even), and random values across the
    range, quantized by the kernel's group quantizer (a group whose amax is 448, scale 1)."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid)].unique()
    values = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.randn(3000) * 30, torch.randn(1000) * 0.01])
    values = values[values.abs() <= 448.0]
    k = 128
    x = torch.nn.functional.pad(values, (0, -values.numel() % (k - 1))).view(-1, k - 1)
    x = torch.cat([x, torch.full((x.shape[0], 1), 448.0)], dim=1)  # pins every row's scale to 1
    w = Fp8BlockWeight(torch.eye(k).to(FP8_DTYPE), torch.ones(1, 1), 128, 128)  # y = x's codes
    got = interpreted["kernels.fp8_triton"].w8a8_block_matmul(x, w)
    assert torch.equal(got, x.to(FP8_DTYPE).float())


def test_fuse_keeps_block_scales_when_aligned_and_expands_them_otherwise() -> None:
    a, b = weight(128, 256, seed=1), weight(256, 256, seed=2)
    fused = fuse_fp8([a, b])
    assert fused.block_n == 128 and fused.scale.shape == (3, 2)
    c = weight(40, 256, seed=3)
    unaligned = fuse_fp8([c, a])
    assert unaligned.block_n == 1 and unaligned.scale.shape == (168, 2)
    want = torch.cat([dequantize_block_fp8(w.codes, w.scale, (w.block_n, 128)) for w in (c, a)])
    assert torch.equal(dequantize_block_fp8(unaligned.codes, unaligned.scale, (1, 128)), want)


def test_fp8_linear_module_on_cpu_is_the_reference() -> None:
    w = weight(48, 160)
    module = Fp8Linear(w, torch.zeros(48))
    x = torch.randn(2, 3, 160)
    assert torch.equal(module(x), w8a8_block_matmul_ref(x.reshape(6, 160), w, torch.zeros(48)).reshape(2, 3, 48))
    assert module.weight_nbytes == 48 * 160 + w.scale.nbytes and not list(module.buffers())[1:]


def experts(e: int, h: int, i: int, seed: int = 0) -> tuple[Fp8ExpertWeights, Fp8ExpertWeights]:
    w13 = Fp8ExpertWeights.stack([[weight(i, h, seed + 3 * x), weight(i, h, seed + 3 * x + 1)] for x in range(e)])
    w2 = Fp8ExpertWeights.stack([[weight(h, i, seed + 3 * x + 2)] for x in range(e)])
    return w13, w2


def routing(t: int, e: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return torch.rand(t, k, generator=g), ids


def test_moe_reference_is_the_per_token_definition() -> None:
    w13, w2 = experts(4, 64, 32)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    weights, ids = routing(3, 4, 2)
    got = fused_experts_fp8_ref(x, w13, w2, weights, ids)
    want = torch.zeros_like(x)
    for t in range(3):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = w8a8_block_matmul_ref(x[t : t + 1], w13.expert(e)).chunk(2, dim=-1)
            down = w8a8_block_matmul_ref(torch.nn.functional.silu(gate) * up, w2.expert(e))
            want[t] += weights[t, j] * down[0]
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("t,e,k,h,i", [(1, 4, 2, 64, 32), (5, 8, 3, 80, 48), (24, 4, 2, 200, 128)])
def test_moe_kernel_matches_reference(
    interpreted: dict[str, ModuleType], t: int, e: int, k: int, h: int, i: int
) -> None:
    """Decode-like, a K tail (80, 200), intermediate sizes below and at one block, more rows than a tile."""
    w13, w2 = experts(e, h, i, seed=t)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(9))
    weights, ids = routing(t, e, k, seed=t + 1)
    module = interpreted["kernels.fused_moe_fp8_triton"]
    got = module.fused_experts_fp8_triton(x, w13, w2, weights, ids)
    want = fused_experts_fp8_ref(x, w13, w2, weights, ids)
    assert got.shape == (t, h) and torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_expert_stack_and_module() -> None:
    w13, w2 = experts(3, 64, 40)
    assert w13.block_n == 1 and w13.scale.shape == (3, 80, 1)  # 40 rows: gate/up fused per row
    assert w2.block_n == 128 and w2.scale.shape == (3, 1, 1)
    module = Fp8Experts(w13, w2)
    x = torch.randn(2, 64)
    weights, ids = routing(2, 3, 2)
    assert torch.equal(module(x, weights, ids), fused_experts_fp8_ref(x, w13, w2, weights, ids))
    assert module.weight_nbytes == w13.nbytes + w2.nbytes
