"""NVFP4 linear layers: the dequantize-then-matmul reference, the operand each device's backend
wants (`prepare_for_kernel`, run once at load), the dispatch (CPU: torch reference; CUDA SM80+:
the Triton kernels, per batch size `matmul_path`; SM100+: FlashInfer's bf16 x fp4 GEMM where it
imports), and `NVFP4Linear`, the module model layers hold."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.nvfp4 import NVFP4Weight, dequantize_nvfp4

if TYPE_CHECKING:
    from kernels.nvfp4_triton import KernelLayout

# The Triton modules (kernels.nvfp4_triton, nvfp4_w4a16, nvfp4_dequant) are imported lazily:
# they need triton (a GPU extra), and importing them fixes whether their kernels run
# interpreted (see the NOTE in kernels.nvfp4_triton).

logger = logging.getLogger("fp4serve.kernels")

# Tokens (rows of x) at and above which a Triton-backed NVFP4 linear dequantizes its weight to a
# scratch copy in x.dtype and calls cuBLAS, rather than run the in-register W4A16 kernel: there
# the GEMM's FLOPs outweigh the scratch's bytes, and cuBLAS's Hopper GEMM beats Triton's
# tiles. Where the two cross on a device is in its `bench.kernels --sweep` report.
DEQUANT_MIN_M = 128


def nvfp4_linear_ref(x: Tensor, w: NVFP4Weight, bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ dequantize(w)^T + bias in x.dtype. The CPU path and every kernel's reference.
    The dequantized weight is a temporary: nothing but the packed form stays resident."""
    return F.linear(x, dequantize_nvfp4(w, x.dtype), None if bias is None else bias.to(x.dtype))


def swizzle_scales_128x4(block_scale: Tensor) -> Tensor:
    """[N, K/16] e4m3 -> the 128x4-swizzled byte layout of cuBLASLt / CUTLASS SM100 (rows padded
    to 128, scale columns to 4, zero-filled): logical (n, g) sits at
    ((n // 128) * ceil(G / 4) + g // 4) * 512 + (n % 32) * 16 + ((n % 128) // 32) * 4 + g % 4."""
    n, groups = block_scale.shape
    n_pad, g_pad = -(-n // 128) * 128, -(-groups // 4) * 4
    padded = torch.zeros(n_pad, g_pad, dtype=torch.uint8, device=block_scale.device)
    padded[:n, :groups] = block_scale.view(torch.uint8)
    # [row tile, n % 32, (n % 128) // 32, column tile, g % 4] -> [row tile, column tile, 32, 4, 4]
    tiles = padded.reshape(n_pad // 128, 4, 32, g_pad // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).contiguous().view(torch.float8_e4m3fn)


# --- SM100+ (Blackwell): FlashInfer's W4A16 GEMM. -----------------------------------------
# UNTESTED: no Blackwell GPU in CI or development. Kept minimal; any failure to import or to
# prepare the weights falls back to the Triton kernel, which also runs on SM100.


@dataclass(frozen=True)
class FlashInferFP4Weight:
    """Weights prepared by `flashinfer.prepare_bf16_fp4_weights` for one FlashInfer backend."""

    weight: Tensor
    block_scale: Tensor
    alpha: Tensor | None  # [1] fp32 decode scale 1/S, one shard only
    row_decode_scale: Tensor | None  # [N] fp32 1/S per row, fused shards (applied after the GEMM)
    backend: str


def _flashinfer_fp4_api() -> tuple[Callable[..., Tensor], Callable[..., tuple]] | None:
    try:
        from flashinfer import mm_bf16_fp4, prepare_bf16_fp4_weights
    except Exception:  # ImportError, or a broken CUDA/JIT environment raising at import
        return None
    return mm_bf16_fp4, prepare_bf16_fp4_weights


def _prepare_flashinfer(w: NVFP4Weight) -> FlashInferFP4Weight | None:
    api = _flashinfer_fp4_api()
    if api is None:
        return None
    _, prepare = api
    decode = 1.0 / w.row_global_scale()  # [N] fp32
    single = w.global_scale.numel() == 1
    alpha = decode[:1].contiguous() if single else None
    for backend in ("cute-dsl", "cudnn"):
        try:
            weight, scale, alpha_p = prepare(w.packed, swizzle_scales_128x4(w.block_scale), alpha, backend=backend)
        except Exception:  # backend missing on this install (cutlass-dsl / cuDNN version)
            continue
        return FlashInferFP4Weight(weight, scale, alpha_p, None if single else decode, backend)
    return None


def _flashinfer_linear(x: Tensor, w: FlashInferFP4Weight, bias: Tensor | None) -> Tensor:
    api = _flashinfer_fp4_api()
    assert api is not None, "a FlashInferFP4Weight exists only where flashinfer imports"
    y = api[0](x.to(torch.bfloat16), w.weight, w.block_scale, w.alpha, backend=w.backend, out_dtype=torch.bfloat16)
    if w.row_decode_scale is not None:
        y = y.float() * w.row_decode_scale
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


# --- dispatch ----------------------------------------------------------------------------

# What `prepare_for_kernel` returns: the canonical weight (torch reference), the Triton kernel's
# layout, or FlashInfer's.
NVFP4Operand = Union[NVFP4Weight, "KernelLayout", FlashInferFP4Weight]


def select_backend(device: torch.device) -> str:
    """ "torch" (CPU, pre-Ampere GPUs), "flashinfer" (SM100+ when it imports) or "triton"."""
    if device.type != "cuda":
        return "torch"
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 10 and _flashinfer_fp4_api() is not None:
        return "flashinfer"
    return "triton" if major >= 8 else "torch"  # Triton's bf16 dots need SM80


def prepare_for_kernel(w: NVFP4Weight) -> NVFP4Operand:
    """The matmul operand for the backend of w's device, built once at load. The result replaces
    `w` as the resident copy (same bytes, re-laid); it is not a dequantized weight."""
    backend = select_backend(w.device)
    if backend == "flashinfer":
        prepared = _prepare_flashinfer(w)
        if prepared is not None:
            return prepared
        backend = "triton"
    if backend == "triton":
        from kernels.nvfp4_triton import pack_kernel_layout

        log_dispatch_once(w.device, *w.shape)
        return pack_kernel_layout(w.packed, w.block_scale, w.row_global_scale())
    return w


def matmul_path(m: int, dequant_min_m: int = DEQUANT_MIN_M) -> str:
    """How a Triton-backed NVFP4 linear runs M tokens: "w4a16" (the in-register kernel of
    kernels.nvfp4_w4a16, one launch) or "dequant" (kernels.nvfp4_dequant to a scratch, then
    cuBLAS)."""
    return "dequant" if m >= dequant_min_m else "w4a16"


def describe_dispatch(n: int, k: int, num_sms: int, ms: tuple[int, ...] = (1, 16, 64, 128, 256)) -> str:
    """One line: the path (and, for the kernel, its tiles) per M for an [N, K] weight."""
    from kernels.nvfp4_w4a16 import choose_config

    parts = [
        f"M={m}: "
        + (choose_config(m, n, k, num_sms).describe() if matmul_path(m) == "w4a16" else "dequantize + cuBLAS")
        for m in ms
    ]
    return f"NVFP4 [{n}x{k}] on {num_sms} SMs: " + "; ".join(parts)


@functools.cache
def log_dispatch_once(device: torch.device, n: int, k: int) -> None:
    """The start-up log's record of the per-M choice, once per weight shape and device."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    logger.info("%s (the kernel below M=%d)", describe_dispatch(n, k, num_sms), DEQUANT_MIN_M)


def backend_of(operand: NVFP4Operand) -> str:
    if isinstance(operand, NVFP4Weight):
        return "torch"
    return "flashinfer" if isinstance(operand, FlashInferFP4Weight) else "triton"


def nvfp4_linear_prepared(x: Tensor, operand: NVFP4Operand, bias: Tensor | None = None) -> Tensor:
    """x [M, K] bf16/fp16/fp32 -> [M, N] in x.dtype, with an operand from `prepare_for_kernel`."""
    if isinstance(operand, NVFP4Weight):
        return nvfp4_linear_ref(x, operand, bias)
    if isinstance(operand, FlashInferFP4Weight):
        return _flashinfer_linear(x, operand, bias)
    if matmul_path(x.shape[0]) == "dequant":
        from kernels.nvfp4_dequant import dequantize_layout

        # [N, K] scratch in x.dtype, freed after the call; cuBLAS does the GEMM.
        return F.linear(x, dequantize_layout(operand, x.dtype), None if bias is None else bias.to(x.dtype))
    from kernels.nvfp4_w4a16 import w4a16_matmul

    return w4a16_matmul(x.contiguous(), operand, bias)


def nvfp4_linear(x: Tensor, w: NVFP4Weight, bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x.dtype, on x's device's backend.

    NOTE: on a GPU this re-lays w on every call; layers use `NVFP4Linear`, which does it once."""
    assert x.device == w.device, f"x on {x.device}, weight on {w.device}"
    if x.device.type == "cpu":
        return nvfp4_linear_ref(x, w, bias)
    return nvfp4_linear_prepared(x, prepare_for_kernel(w), bias)


class NVFP4Linear(torch.nn.Module):
    """A linear layer with NVFP4 weights: y = x @ W^T + b for x [..., K].

    Resident: the prepared packed weights and scales, and the bias; never a dequantized copy.
    NOTE: build it on its final device. The prepared operand is not a registered buffer, so
    `.to(device)` does not move it (and `.to(dtype)` cannot cast its fp8 scales by mistake)."""

    def __init__(self, weight: NVFP4Weight, bias: Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.operand = prepare_for_kernel(weight)
        self.backend = backend_of(self.operand)
        self.bias: Tensor | None
        self.register_buffer("bias", bias)  # [N] or None, in the model's dtype

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        y = nvfp4_linear_prepared(x.reshape(-1, self.in_features), self.operand, self.bias)
        return y.reshape(*lead, self.out_features)

    @property
    def weight_nbytes(self) -> int:
        """Bytes of resident weight data (packed codes and all scales)."""
        op = self.operand
        if isinstance(op, FlashInferFP4Weight):
            return sum(t.nbytes for t in (op.weight, op.block_scale, op.alpha, op.row_decode_scale) if t is not None)
        return op.nbytes

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, backend={self.backend}"
