"""The compiled int4 linear (kernels/cpu_int4.cpp) against its torch reference and the dequantized
float weight, its weight layout, and `Int4Linear` on it against torch's own int4 kernel. Where the
CPU lacks AVX512-BF16 the op runs its plain loop over the same layout: these tests hold either."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.host.cpu_kernels import load_cpu_ops
from engine.weights.formats.int4_linear import (
    Int4Linear,
    dequantize_int4,
    quantize_int4,
    quantize_padded,
)
from kernels.cpu_int4 import (
    int4_gemv,
    int4_gemv_ref,
    pack_int4_codes,
    unpack_int4_codes,
)

BF16 = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def ops() -> None:
    assert load_cpu_ops() is None, "the CPU ops must build here (g++ and torch's headers)"


def bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Sums in float32 then one rounding to bf16: at most one bf16 step of the output's scale apart
    (a sum near a rounding boundary may land on the other side), plus float32 summation order."""
    scale = want.float().abs().amax().clamp(min=1e-3)
    assert (got.float() - want.float()).abs().amax() <= 2**-7 * scale, (got, want)


# (rows, N, K): every input-row count of one pass (1-8), more rows than a pass (9, 11), N off the
# weight-row tiles, K of one group (padded to a pair), 3 groups (padded to two pairs), 8 (one
# superblock), 10, 14 (a superblock and 1 or 3 pairs), SmolLM2's 576 and 1536, and N large enough
# for the threaded path
SHAPES = [
    (1, 64, 32),
    (2, 37, 96),
    (3, 13, 160),
    (4, 130, 64),
    (5, 21, 256),
    (6, 19, 320),
    (7, 33, 448),
    (8, 130, 576),
    (9, 21, 128),
    (11, 18, 320),
    (1, 960, 576),
    (7, 576, 1536),
    (5, 576, 1536),
    (8, 3072, 576),
    (1, 4099, 576),
    (6, 4099, 576),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_int4_gemv_equals_the_dequantized_float_weight(shape: tuple[int, int, int]) -> None:
    rows, n, k = shape
    g = torch.Generator().manual_seed(rows * n + k)
    codes, sz = quantize_int4(torch.randn(n, k, generator=g) * 0.05)
    packed, szp = pack_int4_codes(codes, sz)
    x = torch.randn(rows, k, generator=g).to(BF16)
    got = int4_gemv(x, packed, szp)
    assert got.dtype == BF16 and got.shape == (rows, n)
    bf16_close(got, int4_gemv_ref(x, packed, szp))
    bf16_close(got, (x.float() @ dequantize_int4(codes, sz).t()).to(BF16))


def test_int4_gemv_takes_inputs_short_of_the_padded_columns_and_strided_rows() -> None:
    """K = 100: codes padded to 128 columns (zero codes, scale and zero 0); x keeps its 100 columns,
    and rows may sit in a wider tensor (only the last stride must be 1)."""
    g = torch.Generator().manual_seed(7)
    codes, sz = quantize_padded(torch.randn(24, 100, generator=g))  # [24, 128]: groups of 32
    packed, szp = pack_int4_codes(codes, sz)
    assert packed.shape == (24, 64) and szp.shape == (24, 4, 2)
    wide = torch.randn(3, 160, generator=g).to(BF16)
    x = wide[:, :100]
    want = (x.float() @ dequantize_int4(codes, sz)[:, :100].t()).to(BF16)
    bf16_close(int4_gemv(x, packed, szp), want)
    assert torch.equal(int4_gemv(x, packed, szp), int4_gemv(x.contiguous(), packed, szp))


def test_the_layout_gives_each_32_bit_lane_of_a_superblock_one_group() -> None:
    """In a superblock of 8 groups, nibble m of word e of half q holds group (e / 2) % 8, column
    16 ((e / 2) / 8) + 2 (4q + m) + e % 2 (so each 32-bit lane holds one group); the pairs of groups
    after it hold columns j and j + 16 of each group in word j; pack and unpack are inverse."""
    codes = torch.zeros(1, 320, dtype=torch.uint8)  # 10 groups: one superblock and a pair
    codes[0, 32 + 5] = 3  # group 1, column 5 (h 0, step 2, odd): half 0, word 3, bits 8-11
    codes[0, 96 + 27] = 7  # group 3, column 27 (h 1, step 5, odd): half 1, word 23, bits 4-7
    codes[0, 256 + 20] = 9  # group 8 (the pair's first), column 20: word 4 of the pair, bits 4-7
    codes[0, 288 + 2] = 15  # group 9, column 2: word 2 of the pair, bits 8-11
    packed, _ = pack_int4_codes(codes, torch.zeros(10, 1, 2, dtype=BF16))
    words = packed[0].to(torch.int32)
    words = words[0::2] | (words[1::2] << 8)  # 80 little-endian words: 64 in the superblock, 16 in the pair
    assert words[3].item() == 3 << 8 and words[32 + 23].item() == 7 << 4
    assert words[64 + 4].item() == 9 << 4 and words[64 + 2].item() == 15 << 8
    assert int((words != 0).sum()) == 4
    g = torch.Generator().manual_seed(3)
    for k in (32, 64, 96, 160, 256, 320, 448, 512, 576, 1536):
        random = torch.randint(0, 16, (5, k), dtype=torch.uint8, generator=g)
        packed, _ = pack_int4_codes(random, torch.zeros(k // 32, 5, 2, dtype=BF16))
        assert torch.equal(unpack_int4_codes(packed), F.pad(random, (0, -k % 64)))


def test_int4_gemv_rejects_what_it_cannot_read() -> None:
    codes, sz = quantize_int4(torch.randn(8, 64))
    packed, szp = pack_int4_codes(codes, sz)
    with pytest.raises(RuntimeError, match="bf16 x"):
        int4_gemv(torch.randn(1, 64), packed, szp)
    with pytest.raises(RuntimeError, match="columns of codes"):
        int4_gemv(torch.randn(1, 128).to(BF16), packed, szp)
    with pytest.raises(RuntimeError, match="scales_zeros"):
        int4_gemv(torch.randn(1, 64).to(BF16), packed, szp[:, :1].contiguous())


@pytest.mark.parametrize("shape", [(8, 960, 576), (8, 576, 1536), (11, 4099, 576)])
def test_a_row_gets_the_same_bits_whatever_rows_share_the_call(shape: tuple[int, int, int]) -> None:
    """A speculative verify step's k + 1 rows pass over the weights together; each row's output is
    bit for bit what it gets alone, so greedy output does not change under speculation."""
    rows, n, k = shape
    g = torch.Generator().manual_seed(n + k)
    packed, szp = pack_int4_codes(*quantize_int4(torch.randn(n, k, generator=g) * 0.05))
    x = torch.randn(rows, k, generator=g).to(BF16)
    together = int4_gemv(x, packed, szp)
    for take in (1, 2, 5):
        assert torch.equal(torch.cat([int4_gemv(x[i : i + take], packed, szp) for i in range(0, rows, take)]), together)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int4_linear_on_our_op_matches_torchs_kernel(rows: int) -> None:
    """Same codes, scales and zeros: the two kernels differ by float32 summation order and one bf16
    rounding; padding columns (K = 100) and a bias as the module adds them."""
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(40, 100, generator=g) * 0.05, torch.randn(40, generator=g)
    ours = Int4Linear.from_float(w, b, own_kernel=True)
    theirs = Int4Linear.from_float(w, b, own_kernel=False)
    assert ours.own_kernel and not theirs.own_kernel and "our kernel" in repr(ours)
    assert ours.kernel_weights() is None  # a bias: the one-op layer does not take it
    x = torch.randn(rows, 100, generator=g).to(BF16)
    bf16_close(ours(x), theirs(x))
    plain = Int4Linear.from_float(w, None, own_kernel=True)
    assert plain.kernel_weights() is not None  # padding columns are the op's own business
