"""kernels/nvfp4_scale_search.py: the searched block scale is the standard recipe's when only 6 is
tried, never worse than it block by block, and its codes are the exact rounding for the scale."""

from __future__ import annotations

import pytest
import torch

from kernels.nvfp4 import (
    BLOCK_SIZE,
    NVFP4FormatError,
    dequantize_nvfp4,
    quantize_nvfp4,
    round_to_e2m1_code,
    unpack_e2m1,
)
from kernels.nvfp4_scale_search import quantize_nvfp4_searched


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
