"""The compiled int8 linear (kernels/cpu_gemv.cpp) against its torch reference, and `Int8Linear`
with it switched on against torch's own int8 kernel."""

from __future__ import annotations

import pytest
import torch

from engine.host.cpu_kernels import load_cpu_ops
from engine.weights.formats.int8_linear import Int8Linear, quantize_int8
from kernels.cpu_gemv import int8_gemv, int8_gemv_ref

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# One rounding of a float32 result (bf16/f16: a value near a boundary may land one ulp away),
# relative to the output's scale; float32 differs in summation order only.
TOL = {F32: 1e-5, BF16: 2**-7, F16: 2**-10}


@pytest.fixture(scope="module", autouse=True)
def ops() -> None:
    assert load_cpu_ops() is None, "the CPU ops must build here (g++ and torch's headers)"


def codes_and_scales(n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_int8(torch.randn(n, k) * 0.05, dtype)


# (rows, N, K): one row, every input-row tile size, N off the 4-row tile, K off the vector width,
# and enough work for the threaded path
SHAPES = [
    (1, 576, 576),
    (2, 37, 128),
    (3, 64, 96),
    (4, 130, 64),
    (5, 16, 70),
    (7, 33, 192),
    (8, 4099, 576),
    (11, 65, 640),
    (1, 49152, 576),
]


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("shape", SHAPES)
def test_int8_gemv_equals_its_reference(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    torch.manual_seed(sum(shape))
    rows, n, k = shape
    codes, scales = codes_and_scales(n, k, dtype)
    x = torch.randn(rows, k).to(dtype)
    got, want = int8_gemv(x, codes, scales), int8_gemv_ref(x, codes, scales)
    assert got.dtype == dtype and got.shape == (rows, n)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype] * scale)


def test_int8_gemv_takes_strided_rows_and_zero_inputs() -> None:
    codes, scales = codes_and_scales(40, 128, BF16)
    x = torch.randn(3, 256).to(BF16)[:, :128]  # rows 256 apart
    torch.testing.assert_close(int8_gemv(x, codes, scales).float(), int8_gemv(x.contiguous(), codes, scales).float())
    assert torch.equal(int8_gemv(torch.zeros(2, 128, dtype=BF16), codes, scales), torch.zeros(2, 40, dtype=BF16))


def test_int8_gemv_rejects_mismatched_inputs() -> None:
    codes, scales = codes_and_scales(8, 64, BF16)
    with pytest.raises(RuntimeError, match="x's K"):
        int8_gemv(torch.zeros(1, 32, dtype=BF16), codes, scales)
    with pytest.raises(RuntimeError, match="scales"):
        int8_gemv(torch.zeros(1, 64, dtype=F32), codes, scales)


@pytest.mark.parametrize("k", [576, 100])  # 100: padded to 112 columns for bf16
def test_int8_linear_with_the_op_tracks_torchs_kernel(k: int) -> None:
    """The same codes and scales through both kernels: equal up to one bf16 rounding."""
    torch.manual_seed(k)
    linear = Int8Linear.from_float(torch.randn(300, k) * 0.05, torch.randn(300) * 0.1, BF16)
    x = torch.randn(2, 3, k).to(BF16)
    want = linear(x)
    linear.cpu_gemv = True
    got = linear(x)
    assert got.shape == want.shape == (2, 3, 300)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 2**-7 * want.float().abs().max().item()


def test_a_bf16_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    """A verify step's k + 1 rows (up to 8 per pass over the head, then more passes) each get the
    bits a one-row step gets: greedy output cannot change under speculation."""
    torch.manual_seed(5)
    codes, scales = codes_and_scales(4099, 576, BF16)
    x = torch.randn(11, 576).to(BF16)
    alone = torch.cat([int8_gemv(x[i : i + 1], codes, scales) for i in range(11)])
    for rows in (2, 4, 5, 8, 9, 11):
        assert torch.equal(int8_gemv(x[:rows], codes, scales), alone[:rows]), f"{rows} rows"
