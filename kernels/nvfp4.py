"""The NVFP4 weight format in torch: `NVFP4Weight`, quantize/dequantize, nibble packing,
fusing shards that keep their own global scales, and the ModelOpt / compressed-tensors
tensor layouts. Everything here is exact, device-agnostic torch (no kernels)."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK_SIZE = 16  # elements along K that share one E4M3 block scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Encoding scale numerator: S = 448 * 6 / amax maps the tensor's amax onto the top of both grids.
GLOBAL_SCALE_NUMERATOR = E4M3_MAX * E2M1_MAX  # 2688
# Code -> value; codes 8-15 are the negatives of 0-7 (code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Rows quantized at once: bounds the float64 temporaries to ~64 MiB each.
_QUANTIZE_CHUNK_ELEMENTS = 1 << 23


class NVFP4FormatError(ValueError):
    """A weight or checkpoint tensor that is not valid NVFP4 (wrong shape, dtype or size)."""


@dataclass(frozen=True)
class NVFP4Weight:
    """One linear's weight [N, K] in NVFP4: value = e2m1(code) * block_scale / global_scale.

    A fused weight (q/k/v, gate/up) keeps one global scale per shard: `global_scale` is
    [num_shards] and `shard_sizes` gives each shard's output rows, in order."""

    packed: Tensor  # [N, K/2] uint8; element 2j in the low nibble of byte j, 2j+1 in the high
    block_scale: Tensor  # [N, K/16] float8_e4m3fn, >= 0
    global_scale: Tensor  # [] float32 (one shard) or [num_shards] float32; encode direction S
    shard_sizes: tuple[int, ...] | None = None  # None: one shard of all N rows

    def __post_init__(self) -> None:
        n, half_k = self.packed.shape
        assert self.packed.dtype == torch.uint8, f"packed must be uint8, got {self.packed.dtype}"
        assert self.block_scale.dtype == torch.float8_e4m3fn, f"block_scale is {self.block_scale.dtype}"
        assert self.block_scale.shape == (n, 2 * half_k // BLOCK_SIZE), (
            f"block_scale {tuple(self.block_scale.shape)} does not match packed {tuple(self.packed.shape)}"
        )
        assert (2 * half_k) % BLOCK_SIZE == 0, f"K={2 * half_k} is not a multiple of {BLOCK_SIZE}"
        assert self.global_scale.dtype == torch.float32, f"global_scale is {self.global_scale.dtype}"
        if self.shard_sizes is None:
            assert self.global_scale.numel() == 1, "an unfused weight has one global scale"
        else:
            assert self.global_scale.shape == (len(self.shard_sizes),), (
                f"global_scale {tuple(self.global_scale.shape)} vs {len(self.shard_sizes)} shards"
            )
            assert sum(self.shard_sizes) == n, f"shard sizes {self.shard_sizes} do not sum to N={n}"

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (N, K) of the dequantized weight."""
        return self.packed.shape[0], 2 * self.packed.shape[1]

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.block_scale.nbytes + self.global_scale.nbytes

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def row_global_scale(self) -> Tensor:
        """[N] float32: each output row's global scale S (its shard's)."""
        scales = self.global_scale.reshape(-1)
        if self.shard_sizes is None:
            return scales.expand(self.shape[0]).contiguous()
        sizes = torch.tensor(self.shard_sizes, device=scales.device)
        return scales.repeat_interleave(sizes, output_size=self.shape[0])

    def to(self, device: torch.device | str) -> "NVFP4Weight":
        return NVFP4Weight(
            self.packed.to(device), self.block_scale.to(device), self.global_scale.to(device), self.shard_sizes
        )


def pack_e2m1(codes: Tensor) -> Tensor:
    """[..., K] uint8 codes 0-15 -> [..., K/2] uint8: element 2j low nibble, 2j+1 high nibble."""
    assert codes.dtype == torch.uint8 and codes.shape[-1] % 2 == 0, "need uint8 codes, even K"
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: Tensor) -> Tensor:
    """[..., K/2] uint8 -> [..., K] uint8 codes (inverse of `pack_e2m1`)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def e2m1_to_float(codes: Tensor) -> Tensor:
    """uint8 codes -> float32 E2M1 values (same shape)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def round_to_e4m3(value: Tensor) -> Tensor:
    """float64 >= 0 -> float8_e4m3fn, round-to-nearest-even, saturating at 448.

    NOTE: done on the float64 value directly; `value.to(float8)` would go through float32 and
    could round twice."""
    v = value.clamp(max=E4M3_MAX)
    _, exponent = torch.frexp(v)  # v = m * 2**exponent, m in [0.5, 1)
    # Grid spacing around v: 3 mantissa bits below the leading one; 2**-9 in the subnormals.
    quantum = torch.ldexp(torch.ones_like(v), (exponent - 4).clamp(min=-9))
    return (torch.round(v / quantum) * quantum).to(torch.float8_e4m3fn)  # exact: on the grid


def round_to_e2m1_code(value: Tensor) -> Tensor:
    """float64 -> uint8 E2M1 code: round-to-nearest, ties to the even code, saturating at 6.

    Ties to the even code is the hardware rule (cvt.rn.satfinite.e2m1x2); by value the ties go
    0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4. On each binade the grid is evenly spaced, so
    half-even rounding of value/spacing is exactly that rule. The sign bit is the input's,
    so a small negative becomes -0 (code 8) as ModelOpt and compressed-tensors write it."""
    magnitude = value.abs()
    spacing = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    rounded = (torch.round(magnitude / spacing) * spacing).clamp(max=E2M1_MAX)
    # 2*rounded is in {0,1,2,3,4,6,8,12}; map it to codes 0-7.
    twice_to_code = torch.tensor([0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7], dtype=torch.uint8, device=value.device)
    code = twice_to_code[(rounded * 2).long()]
    return code | (torch.signbit(value).to(torch.uint8) << 3)


def quantize_nvfp4(w: Tensor) -> NVFP4Weight:
    """[N, K] float (any dtype, K a multiple of 16) -> NVFP4Weight with the standard recipe.

    S = float32(2688 / amax); sf = e4m3(S * amax(block) / 6); code = e2m1(x * S / sf).
    The arithmetic is float64 on the exact input values so the result equals the definition.
    Conventions: an all-zero tensor gets S = 1; S is capped at float32's max for tensors too
    tiny for 2688/amax to fit; a block whose scale rounds to 0 encodes every element as 0
    (keeping the input's sign)."""
    if w.dim() != 2 or w.shape[1] % BLOCK_SIZE != 0:
        raise NVFP4FormatError(f"need a [N, K] weight with K a multiple of {BLOCK_SIZE}, got {tuple(w.shape)}")
    if not w.is_floating_point():
        raise NVFP4FormatError(f"need a floating-point weight, got {w.dtype}")
    n, k = w.shape
    amax = w.abs().max().double() if w.numel() else torch.zeros((), dtype=torch.float64, device=w.device)
    if not torch.isfinite(amax):  # one host sync, at load time
        raise NVFP4FormatError("cannot quantize a weight with inf or nan")
    f32_max = torch.finfo(torch.float32).max
    global_scale = torch.where(amax > 0, (GLOBAL_SCALE_NUMERATOR / amax).clamp(max=f32_max), 1.0).to(torch.float32)
    scale64 = global_scale.double()
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
    block_scale = torch.empty(n, k // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=w.device)
    rows_per_chunk = max(1, _QUANTIZE_CHUNK_ELEMENTS // max(k, 1))
    for start in range(0, n, rows_per_chunk):
        stop = min(start + rows_per_chunk, n)
        x = w[start:stop].double().reshape(stop - start, k // BLOCK_SIZE, BLOCK_SIZE)
        sf = round_to_e4m3(scale64 * x.abs().amax(dim=-1) / E2M1_MAX)  # [rows, K/16]
        sf64 = sf.double().unsqueeze(-1)
        # x * S is exact in float64 (24-bit by 24-bit mantissas); one rounding in the division.
        # `x * 0.0` keeps the sign of x for the all-zero-scale blocks.
        scaled = torch.where(sf64 > 0, x * scale64 / sf64, x * 0.0)
        block_scale[start:stop] = sf
        packed[start:stop] = pack_e2m1(round_to_e2m1_code(scaled).reshape(stop - start, k))
    return NVFP4Weight(packed, block_scale, global_scale)


def dequantize_nvfp4(q: NVFP4Weight, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """NVFP4Weight -> [N, K] `dtype`: e2m1(code) * block_scale / S, computed in float32.

    e2m1 * block_scale is exact in float32 and the one division is correctly rounded, so this
    equals the float64 value rounded to float32 (and, by double-rounding safety, to bf16/fp16)."""
    n, k = q.shape
    values = e2m1_to_float(unpack_e2m1(q.packed)).reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    scaled = values * q.block_scale.float().unsqueeze(-1)
    return (scaled / q.row_global_scale().reshape(n, 1, 1)).reshape(n, k).to(dtype)


def fuse_nvfp4(shards: Sequence[NVFP4Weight]) -> NVFP4Weight:
    """Concatenate weights along N (q/k/v, gate/up), each shard keeping its own global scale.

    Exact: no shard is re-quantized to a shared scale (vLLM's max-rescale is not)."""
    if not shards:
        raise NVFP4FormatError("fuse_nvfp4 needs at least one shard")
    ks = {s.shape[1] for s in shards}
    if len(ks) != 1:
        raise NVFP4FormatError(f"shards disagree on K: {sorted(ks)}")
    sizes: list[int] = []
    scales: list[Tensor] = []
    for s in shards:
        sizes.extend(s.shard_sizes or (s.shape[0],))
        scales.append(s.global_scale.reshape(-1))
    return NVFP4Weight(
        packed=torch.cat([s.packed for s in shards]),
        block_scale=torch.cat([s.block_scale for s in shards]),
        global_scale=torch.cat(scales),
        shard_sizes=tuple(sizes),
    )


def _check_packed(packed: Tensor, block_scale: Tensor, name: str) -> None:
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise NVFP4FormatError(f"{name}: packed weight must be 2-D uint8, got {packed.dtype} {tuple(packed.shape)}")
    if block_scale.dtype != torch.float8_e4m3fn:
        raise NVFP4FormatError(f"{name}: weight_scale must be float8_e4m3fn, got {block_scale.dtype}")
    n, half_k = packed.shape
    if (2 * half_k) % BLOCK_SIZE or tuple(block_scale.shape) != (n, 2 * half_k // BLOCK_SIZE):
        raise NVFP4FormatError(
            f"{name}: weight_scale {tuple(block_scale.shape)} does not fit weight {tuple(packed.shape)}"
        )


def _scalar(t: Tensor, name: str) -> Tensor:
    if t.numel() != 1 or not t.is_floating_point():
        raise NVFP4FormatError(f"{name} must be one float, got {t.dtype} {tuple(t.shape)}")
    return t.reshape(())


def _single_shard(q: NVFP4Weight, layout: str) -> None:
    if q.global_scale.numel() != 1:
        raise NVFP4FormatError(f"{layout} stores one global scale per linear; split fused shards first")


def to_modelopt(q: NVFP4Weight) -> dict[str, Tensor]:
    """ModelOpt tensors: weight, weight_scale, weight_scale_2 = 1/S (decode direction)."""
    _single_shard(q, "ModelOpt")
    decode = (1.0 / q.global_scale.reshape(()).double()).to(torch.float32)
    return {"weight": q.packed, "weight_scale": q.block_scale, "weight_scale_2": decode}


def from_modelopt(tensors: Mapping[str, Tensor]) -> NVFP4Weight:
    """ModelOpt's per-linear tensors -> NVFP4Weight (input_scale, for W4A4, is ignored).

    NOTE: S = float32(1 / weight_scale_2) can differ from the producer's 2688/amax by an ulp;
    dequantized values move by ~6e-8 relative, far below bf16 resolution."""
    packed, block_scale = tensors["weight"], tensors["weight_scale"]
    _check_packed(packed, block_scale, "modelopt")
    decode = _scalar(tensors["weight_scale_2"], "weight_scale_2").double()
    if not decode > 0:
        raise NVFP4FormatError(f"weight_scale_2 must be > 0, got {decode.item()}")
    return NVFP4Weight(packed, block_scale, (1.0 / decode).to(torch.float32))


def to_compressed_tensors(q: NVFP4Weight) -> dict[str, Tensor]:
    """compressed-tensors `nvfp4-pack-quantized` tensors; weight_global_scale is S itself."""
    _single_shard(q, "compressed-tensors")
    return {"weight_packed": q.packed, "weight_scale": q.block_scale, "weight_global_scale": q.global_scale.reshape(1)}


def from_compressed_tensors(tensors: Mapping[str, Tensor]) -> NVFP4Weight:
    """compressed-tensors tensors -> NVFP4Weight (input_global_scale, for W4A4, is ignored)."""
    packed, block_scale = tensors["weight_packed"], tensors["weight_scale"]
    _check_packed(packed, block_scale, "compressed-tensors")
    scale = _scalar(tensors["weight_global_scale"], "weight_global_scale").to(torch.float32)
    if not scale > 0:
        raise NVFP4FormatError(f"weight_global_scale must be > 0, got {scale.item()}")
    return NVFP4Weight(packed, block_scale, scale.clone())
