"""The weight-only int8 linear for a few rows as a single CPU op (`torch.ops.fp4serve_cpu.int8_gemv`
of `cpu_gemv.cpp`, compiled and loaded by kernels/cpu_ops.py), and the pure-torch reference the
tests hold it to. It sums in float32 and rounds once to the input's dtype."""

from __future__ import annotations

import torch
from torch import Tensor


def int8_gemv(x: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
    """x [T, K] @ (codes [N, K] int8 * scales [N])^T -> [T, N] in x's dtype (scales in x's dtype)."""
    return torch.ops.fp4serve_cpu.int8_gemv.default(x, codes, scales)


def int8_gemv_ref(x: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
    """What `int8_gemv` computes, up to float32 summation order."""
    return ((x.float() @ codes.float().t()) * scales.float()).to(x.dtype)
