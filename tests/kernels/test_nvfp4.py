"""NVFP4 format: quantize/dequantize against a float64 rendering of the definition, nibble
packing, the ModelOpt and compressed-tensors layouts, fused shards with their own scales."""

import pytest
import torch

from kernels.nvfp4 import (
    NVFP4FormatError,
    NVFP4Weight,
    dequantize_nvfp4,
    from_compressed_tensors,
    from_modelopt,
    fuse_nvfp4,
    pack_e2m1,
    quantize_nvfp4,
    to_compressed_tensors,
    to_modelopt,
    unpack_e2m1,
)

E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
FLOAT32_MAX = 3.4028234663852886e38


# --- the definition, written plainly in float64 ------------------------------------------


def nearest_on_grid(values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the nearest grid point to each value; a tie goes to the even index. Values past
    the grid's end land on its last point (saturation)."""
    distance = (values.unsqueeze(-1) - grid).abs()
    is_nearest = distance == distance.min(dim=-1, keepdim=True).values
    is_even = torch.arange(len(grid)) % 2 == 0
    return (is_nearest.to(torch.int64) * (1 + is_even.to(torch.int64))).argmax(dim=-1)


def e4m3_grid() -> torch.Tensor:
    """All finite non-negative E4M3 values in bit-pattern order (0x00..0x7E; 0x7F is NaN)."""
    return torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()


def reference_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] uint8, block scale bits [N, K/16] uint8, S float32) by the definition."""
    x = w.double()
    amax = x.abs().max().item()
    s = 1.0 if amax == 0 else min(2688.0 / amax, FLOAT32_MAX)
    s = torch.tensor(s, dtype=torch.float32)
    s64 = s.double().item()
    blocks = x.reshape(x.shape[0], -1, 16)
    scale_bits = nearest_on_grid(s64 * blocks.abs().amax(dim=-1) / 6.0, e4m3_grid())  # bit pattern
    sf = e4m3_grid()[scale_bits].unsqueeze(-1)
    scaled = torch.where(sf > 0, blocks * s64 / sf, torch.zeros_like(blocks))
    magnitude_code = nearest_on_grid(scaled.abs(), E2M1_MAGNITUDES)
    codes = magnitude_code + 8 * torch.signbit(blocks).to(torch.int64)
    return codes.reshape(w.shape).to(torch.uint8), scale_bits.to(torch.uint8), s


def reference_dequantize(codes: torch.Tensor, scale_bits: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """float64 e2m1(code) * sf / S."""
    values = E2M1_MAGNITUDES[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0).double()
    sf = e4m3_grid()[scale_bits.long()].repeat_interleave(16, dim=1)
    return values * sf / s.double()


# --- factories ----------------------------------------------------------------------------


def gaussian(n: int, k: int, std: float = 1.0, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * std).to(dtype)


def with_zero_blocks(n: int, k: int) -> torch.Tensor:
    w = gaussian(n, k, seed=3)
    w[::2, 16:48] = 0.0  # whole zero blocks inside a non-zero tensor
    w[1, :16] = -0.0
    return w


def with_vanishing_blocks(n: int, k: int) -> torch.Tensor:
    """Blocks whose scale rounds to e4m3 zero while the tensor's amax is large."""
    w = gaussian(n, k, seed=4) * 1e-12
    w[0, 0] = 1e6
    return w


CASES = {
    "gaussian": lambda: gaussian(32, 128),
    "gaussian_std_0.02": lambda: gaussian(64, 256, std=0.02, seed=1),
    "bfloat16": lambda: gaussian(16, 64, seed=2, dtype=torch.bfloat16),
    "float16": lambda: gaussian(16, 64, seed=5, dtype=torch.float16),
    "all_zero": lambda: torch.zeros(8, 32),
    "zero_blocks": lambda: with_zero_blocks(8, 64),
    "vanishing_blocks": lambda: with_vanishing_blocks(8, 64),
    "tiny_1e-30": lambda: gaussian(8, 64, std=1e-30, seed=6),
    "tiny_below_2688_over_float32_max": lambda: gaussian(8, 64, std=1e-37, seed=7),
    "huge_1e37": lambda: gaussian(8, 64, std=1e37, seed=8),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_quantize_equals_float64_definition(case: str) -> None:
    w = CASES[case]()
    q = quantize_nvfp4(w)
    codes, scale_bits, s = reference_quantize(w)
    assert torch.equal(unpack_e2m1(q.packed), codes)
    assert torch.equal(q.block_scale.view(torch.uint8), scale_bits)
    assert q.global_scale.dtype == torch.float32 and q.global_scale.shape == ()
    assert q.global_scale.item() == s.item()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_equals_float64_definition(case: str, dtype: torch.dtype) -> None:
    q = quantize_nvfp4(CASES[case]())
    expected = reference_dequantize(unpack_e2m1(q.packed), q.block_scale.view(torch.uint8), q.global_scale)
    out = dequantize_nvfp4(q, dtype)
    assert out.dtype == dtype
    assert torch.equal(out, expected.to(dtype))


def test_quantizing_in_row_chunks_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels.nvfp4

    w = with_zero_blocks(9, 64)
    whole = quantize_nvfp4(w)
    monkeypatch.setattr(kernels.nvfp4, "_QUANTIZE_CHUNK_ELEMENTS", 2 * 64)  # two rows at a time
    chunked = quantize_nvfp4(w)
    assert torch.equal(chunked.packed, whole.packed)
    assert torch.equal(chunked.block_scale.view(torch.uint8), whole.block_scale.view(torch.uint8))


def test_ties_round_to_the_even_code() -> None:
    # S = 1 (amax 2688 in row 0) and row 1's block amax 6 gives sf = 1, so row 1 codes x itself.
    w = torch.zeros(2, 16)
    w[0, 0] = 2688.0
    w[1] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -5.0, 5.5, 0.1, -0.1, 4.5, -6.0])
    q = quantize_nvfp4(w)
    assert q.global_scale.item() == 1.0 and q.block_scale[1].float().item() == 1.0
    assert unpack_e2m1(q.packed)[1].tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 14, 7, 0, 8, 6, 15]


def test_all_zero_tensor_gets_unit_global_scale() -> None:
    q = quantize_nvfp4(torch.zeros(4, 32))
    assert q.global_scale.item() == 1.0
    assert not q.packed.any() and not q.block_scale.view(torch.uint8).any()
    assert not dequantize_nvfp4(q, torch.float32).any()


def test_gaussian_weights_have_the_known_relative_error() -> None:
    w = gaussian(512, 1024, std=0.02, seed=0)
    error = (dequantize_nvfp4(quantize_nvfp4(w), torch.float32) - w).norm() / w.norm()
    assert 0.08 < error.item() < 0.11


def test_packing_puts_the_even_element_in_the_low_nibble() -> None:
    codes = torch.tensor([[1, 2, 3, 4, 15, 0, 0, 8]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F, 0x80]]
    assert torch.equal(unpack_e2m1(packed), codes)


def test_unpack_inverts_pack_on_every_byte() -> None:
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(pack_e2m1(unpack_e2m1(every_byte)), every_byte)


@pytest.mark.parametrize(("n", "k"), [(1, 16), (48, 80), (3, 1024)])
def test_nbytes_is_about_0_5625_bytes_per_weight(n: int, k: int) -> None:
    q = quantize_nvfp4(gaussian(n, k))
    assert q.shape == (n, k)
    assert q.nbytes == n * k // 2 + n * k // 16 + 4


def test_modelopt_round_trip() -> None:
    q = quantize_nvfp4(gaussian(48, 80, seed=9))
    tensors = to_modelopt(q)
    assert sorted(tensors) == ["weight", "weight_scale", "weight_scale_2"]
    assert tensors["weight"].dtype == torch.uint8 and tensors["weight"].shape == (48, 40)
    assert tensors["weight_scale"].dtype == torch.float8_e4m3fn and tensors["weight_scale"].shape == (48, 5)
    assert tensors["weight_scale_2"].dtype == torch.float32 and tensors["weight_scale_2"].shape == ()
    # Decode direction: amax / 2688, to float32 rounding.
    amax = gaussian(48, 80, seed=9).abs().max().item()
    assert tensors["weight_scale_2"].item() == pytest.approx(amax / 2688.0, rel=1e-7)
    back = from_modelopt({**tensors, "input_scale": torch.tensor(0.5)})
    assert torch.equal(back.packed, q.packed)
    assert torch.equal(back.block_scale.view(torch.uint8), q.block_scale.view(torch.uint8))
    assert back.global_scale.item() == pytest.approx(q.global_scale.item(), rel=2**-23)


def test_modelopt_dequantization_formula_matches() -> None:
    """ModelOpt defines W = e2m1 * weight_scale * weight_scale_2."""
    tensors = to_modelopt(quantize_nvfp4(gaussian(16, 64, seed=10)))
    values = E2M1_MAGNITUDES[(unpack_e2m1(tensors["weight"]) & 7).long()]
    values = values * torch.where(unpack_e2m1(tensors["weight"]) >= 8, -1.0, 1.0).double()
    expected = values * tensors["weight_scale"].double().repeat_interleave(16, 1) * tensors["weight_scale_2"].double()
    got = dequantize_nvfp4(from_modelopt(tensors), torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0.0)


def test_compressed_tensors_round_trip_is_exact() -> None:
    q = quantize_nvfp4(gaussian(32, 48, seed=11))
    tensors = to_compressed_tensors(q)
    assert sorted(tensors) == ["weight_global_scale", "weight_packed", "weight_scale"]
    assert tensors["weight_global_scale"].shape == (1,)
    # Stored inverted relative to ModelOpt: the encode direction, 2688 / amax.
    assert tensors["weight_global_scale"].item() == q.global_scale.item()
    back = from_compressed_tensors({**tensors, "input_global_scale": torch.tensor([3.0])})
    assert torch.equal(back.packed, q.packed)
    assert torch.equal(back.block_scale.view(torch.uint8), q.block_scale.view(torch.uint8))
    assert back.global_scale.item() == q.global_scale.item()
    assert torch.equal(dequantize_nvfp4(back, torch.float32), dequantize_nvfp4(q, torch.float32))


@pytest.mark.parametrize(
    "bad",
    [
        {"weight": torch.zeros(4, 8, dtype=torch.int8)},
        {"weight_scale": torch.zeros(4, 1, dtype=torch.float32)},
        {"weight_scale": torch.zeros(4, 2, dtype=torch.uint8).view(torch.float8_e4m3fn)},
        {"weight_scale_2": torch.tensor([1.0, 2.0])},
        {"weight_scale_2": torch.tensor(0.0)},
    ],
)
def test_malformed_modelopt_tensors_raise_format_error(bad: dict[str, torch.Tensor]) -> None:
    good = to_modelopt(quantize_nvfp4(gaussian(4, 16)))
    with pytest.raises(NVFP4FormatError):
        from_modelopt({**good, **bad})


@pytest.mark.parametrize(
    "w", [torch.zeros(4, 24), torch.zeros(64), torch.zeros(4, 16, dtype=torch.int32), torch.full((2, 16), float("inf"))]
)
def test_unquantizable_weights_raise_format_error(w: torch.Tensor) -> None:
    with pytest.raises(NVFP4FormatError):
        quantize_nvfp4(w)


def make_shards(sizes: tuple[int, ...], k: int, magnitudes: tuple[float, ...]) -> list[NVFP4Weight]:
    return [quantize_nvfp4(gaussian(n, k, std=m, seed=20 + i)) for i, (n, m) in enumerate(zip(sizes, magnitudes))]


def test_fused_shards_keep_their_own_global_scales_exactly() -> None:
    # q/k/v-like shards whose magnitudes differ by 1000x: one shared scale would push the small
    # shard's block scales into e4m3's subnormals and lose most of its bits.
    shards = make_shards((32, 16, 16), 64, (1.0, 1e-3, 0.05))
    fused = fuse_nvfp4(shards)
    assert fused.shard_sizes == (32, 16, 16)
    assert fused.global_scale.shape == (3,)
    assert torch.equal(fused.global_scale, torch.stack([s.global_scale for s in shards]))
    expected = torch.cat([dequantize_nvfp4(s, torch.float32) for s in shards])
    assert torch.equal(dequantize_nvfp4(fused, torch.float32), expected)


def test_row_global_scale_repeats_each_shard_scale_over_its_rows() -> None:
    fused = fuse_nvfp4(make_shards((2, 3), 16, (1.0, 10.0)))
    rows = fused.row_global_scale()
    assert rows.shape == (5,)
    assert rows.tolist() == [fused.global_scale[0].item()] * 2 + [fused.global_scale[1].item()] * 3


def test_fusing_a_fused_weight_flattens_its_shards() -> None:
    a, b, c = make_shards((2, 3, 4), 32, (1.0, 2.0, 3.0))
    fused = fuse_nvfp4([fuse_nvfp4([a, b]), c])
    assert fused.shard_sizes == (2, 3, 4)
    assert torch.equal(dequantize_nvfp4(fused, torch.float32), dequantize_nvfp4(fuse_nvfp4([a, b, c]), torch.float32))


def test_fusing_shards_of_different_k_raises() -> None:
    with pytest.raises(NVFP4FormatError):
        fuse_nvfp4([quantize_nvfp4(gaussian(2, 16)), quantize_nvfp4(gaussian(2, 32))])


def test_checkpoint_layouts_refuse_fused_weights() -> None:
    fused = fuse_nvfp4(make_shards((2, 2), 16, (1.0, 2.0)))
    with pytest.raises(NVFP4FormatError):
        to_modelopt(fused)
    with pytest.raises(NVFP4FormatError):
        to_compressed_tensors(fused)
