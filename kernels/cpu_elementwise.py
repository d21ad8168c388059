"""A decoder layer's elementwise work as single CPU ops (`torch.ops.fp4serve_cpu.*` of
`cpu_elementwise.cpp`, compiled and loaded by kernels/cpu_ops.py): RMSNorm, the residual add fused
with RMSNorm, SwiGLU's silu(gate) * up, RoPE's rotation; and the pure-torch references the tests
hold them to. The ops compute in float32 and round once to the input's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., H] -> x * rsqrt(mean(x^2) + eps) * weight, in x's dtype."""
    return torch.ops.fp4serve_cpu.rms_norm.default(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(residual + x, rms_norm(residual + x)); the sum rounded to x's dtype before the norm."""
    return torch.ops.fp4serve_cpu.add_rms_norm.default(x, residual, weight, eps)


def silu_and_mul(x: Tensor) -> Tensor:
    """x [..., 2I] (gate, then up) -> silu(gate) * up [..., I]."""
    return torch.ops.fp4serve_cpu.silu_and_mul.default(x)


def rotary(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x [T, H, D] -> x * cos + roll(x, D/2) * signed_sin, cos/signed_sin [T, D]."""
    return torch.ops.fp4serve_cpu.rotary.default(x, cos, signed_sin)


def argmax_rows(x: Tensor) -> Tensor:
    """x [B, V] float32 -> int64 [B], each row's argmax (ties and NaN as torch.argmax)."""
    return torch.ops.fp4serve_cpu.argmax_rows.default(x)


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


def add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    total = residual + x
    return total, rms_norm_ref(total, weight, eps)


def silu_and_mul_ref(x: Tensor) -> Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def rotary_ref(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    xf = x.float()
    half = x.shape[-1] // 2
    return (xf * cos.float()[:, None] + xf.roll(half, dims=-1) * signed_sin.float()[:, None]).to(x.dtype)
