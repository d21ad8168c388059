"""kernels/nvfp4_scale_search.py: the searched block scale is the standard recipe's when only 6 is
tried, never worse than it block by block, its codes are the exact rounding for the scale, and it
is bit for bit the first, plainer float64 search (kept here as the reference)."""

from __future__ import annotations

import pytest
import torch

from kernels import nvfp4_scale_search as scale_search
from kernels.nvfp4 import (
    BLOCK_SIZE,
    GLOBAL_SCALE_NUMERATOR,
    NVFP4FormatError,
    NVFP4Weight,
    dequantize_nvfp4,
    e2m1_to_float,
    pack_e2m1,
    quantize_nvfp4,
    round_to_e2m1_code,
    round_to_e4m3,
    unpack_e2m1,
)
from kernels.nvfp4_scale_search import SCALE_DIVISORS, quantize_nvfp4_searched


def weight(n: int = 64, k: int = 256, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[3, 17] = 0.4  # an outlier sets the global scale, as in real checkpoints
    return w


def block_errors(w: torch.Tensor, q: object) -> torch.Tensor:
    deq = dequantize_nvfp4(q, torch.float64).double()  # type: ignore[arg-type]
    return ((deq - w.double()) ** 2).reshape(w.shape[0], -1, BLOCK_SIZE).sum(-1)


def test_trying_only_6_is_the_standard_recipe() -> None:
    w = weight()
    a, b = quantize_nvfp4(w), quantize_nvfp4_searched(w, (6.0,))
    assert torch.equal(a.packed, b.packed) and torch.equal(a.global_scale, b.global_scale)
    assert torch.equal(a.block_scale.float(), b.block_scale.float())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_block_is_at_least_as_close_and_the_whole_is_closer(seed: int) -> None:
    w = weight(seed=seed)
    standard, searched = block_errors(w, quantize_nvfp4(w)), block_errors(w, quantize_nvfp4_searched(w))
    assert bool((searched <= standard).all())
    assert searched.sum() < 0.85 * standard.sum()


def test_codes_are_the_exact_rounding_for_the_chosen_scale() -> None:
    w = weight(seed=4)
    q = quantize_nvfp4_searched(w)
    sf = q.block_scale.double().repeat_interleave(BLOCK_SIZE, dim=1)  # [N, K]
    scaled = torch.where(sf > 0, w.double() * q.global_scale.double() / sf, w.double() * 0.0)
    assert torch.equal(unpack_e2m1(q.packed), round_to_e2m1_code(scaled))


def test_a_weight_it_cannot_quantize_is_a_format_error() -> None:
    with pytest.raises(NVFP4FormatError, match="multiple of 16"):
        quantize_nvfp4_searched(torch.zeros(4, 20))
    with pytest.raises(NVFP4FormatError, match="inf or nan"):
        quantize_nvfp4_searched(torch.full((2, 16), float("nan")))


def reference_search(w: torch.Tensor, divisors: tuple[float, ...] = SCALE_DIVISORS) -> NVFP4Weight:
    """The first version of the search, kept as its definition: every candidate's codes through
    `round_to_e2m1_code` and its error through `e2m1_to_float`, all in float64, one weight at once."""
    amax = w.abs().max().double()
    global_scale = torch.where(
        amax > 0, (GLOBAL_SCALE_NUMERATOR / amax).clamp(max=torch.finfo(torch.float32).max), 1.0
    ).to(torch.float32)
    scale64 = global_scale.double()
    n, k = w.shape
    x = w.double().reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    block_amax = x.abs().amax(dim=-1)
    best_err = best_sf = best_code = None
    for divisor in divisors:
        sf = round_to_e4m3(scale64 * block_amax / divisor)
        sf64 = sf.double().unsqueeze(-1)
        code = round_to_e2m1_code(torch.where(sf64 > 0, x * scale64 / sf64, x * 0.0))
        err = ((e2m1_to_float(code).double() * sf64 / scale64 - x) ** 2).sum(dim=-1)
        if best_err is None:
            best_err, best_sf, best_code = err, sf, code
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_sf = torch.where(better, sf.float(), best_sf.float()).to(torch.float8_e4m3fn)
        best_code = torch.where(better.unsqueeze(-1), code, best_code)
    assert best_sf is not None and best_code is not None
    return NVFP4Weight(pack_e2m1(best_code.reshape(n, k)), best_sf, global_scale)


def midpoint_weight(dtype: torch.dtype) -> torch.Tensor:
    """Blocks of k/4 (k = 0..28, either sign, some -0) with the tensor's amax 6: S = 448 = the
    standard scale, so x * S / sf lands exactly on every midpoint E2M1 rounds ties at."""
    g = torch.Generator().manual_seed(7)
    k = torch.randint(0, 29, (48, 64), generator=g).to(dtype) / 4
    w = torch.where(torch.rand(48, 64, generator=g) < 0.5, -k, k)
    w[0, 0] = 6.0
    w[1, :16] = -0.0
    w[2, 16:32] = 0.0
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_search_is_the_reference_search_bit_for_bit(dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(96, 160, generator=g, dtype=torch.float64) * 0.02
    w[3, 17] = 0.4
    w[5, 32:48] = 1e-12  # a block far below the global amax: its scale rounds to 0
    w[6, 48:64] = torch.randn(16, generator=g, dtype=torch.float64) * 1e-5  # E4M3 subnormal scales
    w[7, :16] = 0.0
    for case in (w.to(dtype), midpoint_weight(dtype)):
        for divisors in (SCALE_DIVISORS, (6.0,), (8.0, 4.0, 6.0)):
            got, want = quantize_nvfp4_searched(case, divisors), reference_search(case, divisors)
            assert torch.equal(got.packed, want.packed)
            assert torch.equal(got.block_scale.view(torch.uint8), want.block_scale.view(torch.uint8))
            assert torch.equal(got.global_scale, want.global_scale)


def test_the_search_is_the_reference_search_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scale_search, "_CHUNK_ELEMENTS", 3 * 64)  # 3 rows a chunk, the last one short
    w = weight(n=10, k=64, seed=5)
    got, want = quantize_nvfp4_searched(w), reference_search(w)
    assert torch.equal(got.packed, want.packed)
    assert torch.equal(got.block_scale.view(torch.uint8), want.block_scale.view(torch.uint8))
