"""NVFP4 quantization with a searched block scale: the same format as `quantize_nvfp4` (one float32
global scale per tensor, one E4M3 scale per 16 weights, E2M1 codes), but each block's scale is the
candidate, among a few divisors of the block's amax, whose dequantized block is closest to the
input in squared error. The standard recipe always maps the block's amax onto 6, E2M1's top; a
block whose other values fall between E2M1's coarse steps (4 -> 6) often does better with amax
mapped to 5 or 7 (clipping the largest weight a little). Any NVFP4 kernel reads the result."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kernels.nvfp4 import (
    BLOCK_SIZE,
    E2M1_MAX,
    E2M1_VALUES,
    GLOBAL_SCALE_NUMERATOR,
    NVFP4FormatError,
    NVFP4Weight,
    pack_e2m1,
    round_to_e4m3,
)

# amax / scale tried for each block; E2M1_MAX first, so ties keep the standard recipe's choice.
SCALE_DIVISORS = (E2M1_MAX, 4.0, 4.5, 5.0, 5.5, 6.5, 7.0, 8.0)
_CHUNK_ELEMENTS = 1 << 22  # weights x divisors searched at once: float64 temporaries of 32 MiB each
# Where `round_to_e2m1_code` moves from one magnitude code to the next (the midpoints of E2M1's grid),
# and which way a value exactly there goes: ties go to the even code, so 0.75, 1.75 and 3.5 round up.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (False, True, False, True, False, True, False)


def quantize_nvfp4_searched(w: Tensor, divisors: tuple[float, ...] = SCALE_DIVISORS) -> NVFP4Weight:
    """[N, K] float (K a multiple of 16) -> NVFP4Weight with each block's scale searched.

    With `divisors == (6.0,)` this is exactly `quantize_nvfp4`: the codes are
    `round_to_e2m1_code(x * S / sf)` and each candidate's error is the float64
    `sum((e2m1(code) * sf / S - x) ** 2)`, bit for bit."""
    if w.dim() != 2 or w.shape[1] % BLOCK_SIZE != 0:
        raise NVFP4FormatError(f"need a [N, K] weight with K a multiple of {BLOCK_SIZE}, got {tuple(w.shape)}")
    if not w.is_floating_point():
        raise NVFP4FormatError(f"need a floating-point weight, got {w.dtype}")
    n, k = w.shape
    amax = w.abs().max().double() if w.numel() else torch.zeros((), dtype=torch.float64, device=w.device)
    if not torch.isfinite(amax):
        raise NVFP4FormatError("cannot quantize a weight with inf or nan")
    f32_max = torch.finfo(torch.float32).max
    global_scale = torch.where(amax > 0, (GLOBAL_SCALE_NUMERATOR / amax).clamp(max=f32_max), 1.0).to(torch.float32)
    scale64 = global_scale.double()
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float64, device=w.device)  # code 0-7 -> value
    candidates = torch.tensor(divisors, dtype=torch.float64, device=w.device)  # [D]
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
    block_scale = torch.empty(n, k // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=w.device)
    # Every divisor is tried in the same pass ([rows, K/16, D, 16] temporaries): a handful of large
    # ops per chunk instead of a score per divisor, since each op is a parallel region whose start
    # costs more than its work on a busy CPU.
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(k * len(divisors), 1))
    for start in range(0, n, rows_per_chunk):
        stop = min(start + rows_per_chunk, n)
        x = w[start:stop].double().reshape(stop - start, k // BLOCK_SIZE, BLOCK_SIZE)  # [rows, K/16, 16]
        x_abs = x.abs()
        scaled_abs = x_abs * scale64  # |x * S|, rounded as the reference rounds x * S
        block_amax = x_abs.amax(dim=-1, keepdim=True)  # [rows, K/16, 1]
        sf64 = round_to_e4m3(scale64 * block_amax / candidates).double()  # [rows, K/16, D] e4m3 values
        # NOTE: -e2m1(c) * sf / S - x == -(e2m1(c) * sf / S - |x|) exactly for x < 0 (code c
        # carries x's sign), so squaring the magnitudes' difference gives the reference's terms.
        dequantized = magnitudes * sf64.unsqueeze(-1) / scale64  # [rows, K/16, D, 8] per code
        diff = torch.gather(dequantized, -1, _codes(scaled_abs.unsqueeze(-2), sf64)).sub_(x_abs.unsqueeze(-2))
        err = diff.mul_(diff).sum(dim=-1)  # [rows, K/16, D]
        # argmin keeps the first of equal errors: E2M1_MAX, listed first, wins ties.
        best_sf64 = sf64.gather(-1, err.argmin(dim=-1, keepdim=True)).squeeze(-1)  # [rows, K/16]
        block_scale[start:stop] = best_sf64.to(torch.float8_e4m3fn)  # exact: an e4m3 value
        sign = torch.signbit(x).to(torch.int64) << 3  # the input's sign, even for -0
        code = _codes(scaled_abs, best_sf64).add_(sign).to(torch.uint8)
        packed[start:stop] = pack_e2m1(code.reshape(stop - start, k))
    return NVFP4Weight(packed, block_scale, global_scale)


def _codes(scaled_abs: Tensor, sf64: Tensor) -> Tensor:
    """The magnitude codes of `round_to_e2m1_code(x * S / sf)`: [..., 16] float64 |x * S| and [...]
    float64 scales (broadcast) -> [..., 16] int64 codes 0-7. A block whose scale is 0
    divides by inf instead, so every element encodes as code 0, as in `quantize_nvfp4`."""
    divisor = torch.where(sf64 > 0, sf64, math.inf).unsqueeze(-1)  # [..., 1]
    value = scaled_abs / divisor  # the reference's |x * S / sf|, rounded the same way
    # The code is how many midpoints the value is past; comparing with scalars is one vectorized
    # pass each, where torch.bucketize searches per element.
    code = torch.zeros_like(value, dtype=torch.uint8)
    past = torch.empty_like(value, dtype=torch.bool)
    for midpoint, tie_up in zip(_MIDPOINTS, _TIES_UP):
        code += (torch.ge if tie_up else torch.gt)(value, midpoint, out=past)
    return code.long()
