"""NVFP4 quantization with a searched block scale: the same format as `quantize_nvfp4` (one float32
global scale per tensor, one E4M3 scale per 16 weights, E2M1 codes), but each block's scale is the
candidate, among a few divisors of the block's amax, whose dequantized block is closest to the
input in squared error. The standard recipe always maps the block's amax onto 6, E2M1's top; a
block whose other values fall between E2M1's coarse steps (4 -> 6) often does better with amax
mapped to 5 or 7 (clipping the largest weight a little). Any NVFP4 kernel reads the result."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.nvfp4 import (
    BLOCK_SIZE,
    E2M1_MAX,
    GLOBAL_SCALE_NUMERATOR,
    NVFP4FormatError,
    NVFP4Weight,
    e2m1_to_float,
    pack_e2m1,
    round_to_e2m1_code,
    round_to_e4m3,
)

# amax / scale tried for each block; E2M1_MAX first, so ties keep the standard recipe's choice.
SCALE_DIVISORS = (E2M1_MAX, 4.0, 4.5, 5.0, 5.5, 6.5, 7.0, 8.0)
_CHUNK_ELEMENTS = 1 << 21  # rows searched at once: bounds the float64 temporaries to ~16 MiB each


def quantize_nvfp4_searched(w: Tensor, divisors: tuple[float, ...] = SCALE_DIVISORS) -> NVFP4Weight:
    """[N, K] float (K a multiple of 16) -> NVFP4Weight with each block's scale searched.

    With `divisors == (6.0,)` this is exactly `quantize_nvfp4`. Arithmetic is float64 on the exact
    input values, as there."""
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
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
    block_scale = torch.empty(n, k // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=w.device)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(k, 1))
    for start in range(0, n, rows_per_chunk):
        stop = min(start + rows_per_chunk, n)
        x = w[start:stop].double().reshape(stop - start, k // BLOCK_SIZE, BLOCK_SIZE)  # [rows, K/16, 16]
        block_amax = x.abs().amax(dim=-1)
        best_err = best_sf = best_code = None
        for divisor in divisors:
            sf = round_to_e4m3(scale64 * block_amax / divisor)  # [rows, K/16] e4m3
            sf64 = sf.double().unsqueeze(-1)
            code = round_to_e2m1_code(torch.where(sf64 > 0, x * scale64 / sf64, x * 0.0))  # [rows, K/16, 16]
            err = ((e2m1_to_float(code).double() * sf64 / scale64 - x) ** 2).sum(dim=-1)  # [rows, K/16]
            if best_err is None:
                best_err, best_sf, best_code = err, sf, code
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_sf = torch.where(better, sf.float(), best_sf.float()).to(torch.float8_e4m3fn)
            best_code = torch.where(better.unsqueeze(-1), code, best_code)
        assert best_sf is not None and best_code is not None, "at least one divisor"
        block_scale[start:stop] = best_sf
        packed[start:stop] = pack_e2m1(best_code.reshape(stop - start, k))
    return NVFP4Weight(packed, block_scale, global_scale)
