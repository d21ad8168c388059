"""A dense int4 decoder layer for a few rows as one CPU op (`torch.ops.fp4serve_cpu.decode_layer_int4`
of `cpu_decode_layer.cpp`, compiled and loaded by kernels/cpu_ops.py): the ops the Python layer
runs, called from C++."""

from __future__ import annotations

import torch
from torch import Tensor


def decode_layer_int4(
    x: Tensor,
    input_norm: Tensor,
    post_norm: Tensor,
    eps: float,
    weights: tuple[Tensor, ...],
    group_size: int,
    cos: Tensor,
    signed_sin: Tensor,
    kv_cache: Tensor,
    meta: tuple[Tensor, ...],
    num_heads: int,
    scale: float,
    own_kernel: bool,
) -> Tensor:
    """x [T, H] -> the layer's output [T, H]. `weights`: (packed codes, scales and zeros) of qkv, o,
    gate_up and down (Int4Linear.kernel_weights); `meta`: CpuAttentionBackend.decode_meta();
    cos/signed_sin [T, D] (PositionedRotary's rows); `own_kernel`: the codes are in our int4 op's
    layout (Int4Linear.own_kernel), else in torch's."""
    return torch.ops.fp4serve_cpu.decode_layer_int4.default(
        x,
        input_norm,
        post_norm,
        eps,
        *weights,
        group_size,
        cos,
        signed_sin,
        kv_cache,
        *meta,
        num_heads,
        scale,
        own_kernel,
    )
