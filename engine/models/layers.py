"""Shared layers of the decoder models: RMSNorm, rotary embeddings (default, linear, llama3,
yarn), and linear layers whose weights may be fused from several checkpoint tensors.

Numerics follow transformers' implementations so float32 logits match to ~1e-5.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from engine.weights.config.model_config import RopeConfig
from kernels import cpu_elementwise


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.cpu_ops = False  # the fused C++ op of kernels/cpu_elementwise.py (decoder.use_cpu_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops:
            return cpu_elementwise.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            # One fused aten op; bit-identical to the ops below in float32 (checked in tests).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] float32 and the cos/sin scaling ("attention factor")."""
    dim = head_dim
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / pos_freqs
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings or max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    assert rope.rope_type == "yarn", f"unknown rope type {rope.rope_type}"
    return _yarn_inv_freq(rope, dim, max_position_embeddings, pos_freqs)


def _yarn_inv_freq(rope: RopeConfig, dim: int, max_pos: int, pos_freqs: torch.Tensor) -> tuple[torch.Tensor, float]:
    factor = rope.factor
    orig = rope.original_max_position_embeddings or max_pos

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An `nn.Embedding` without its random init: the checkpoint fills it. In the loader's meta
    build, `normal_` on a meta tensor would run torch's Python decomposition, whose first use
    imports torch._dynamo: seconds of every engine start."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to `max_len`, gathered by position each forward."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int, max_len: int) -> None:
        super().__init__()
        if torch.get_default_device().type == "meta":
            # A build without storage (engine/weights/loader.py) computes the tables once the
            # model has a device. Arithmetic on meta tensors runs torch's Python decompositions,
            # whose first use imports torch._dynamo and sympy: seconds of every engine start.
            self.register_buffer("cos", torch.empty(max_len, head_dim), persistent=False)
            self.register_buffer("sin", torch.empty(max_len, head_dim), persistent=False)
            return
        inv_freq, scaling = rope_inv_freq(rope, head_dim, max_position_embeddings)
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # [max_len, head_dim] float32; cast to the activation dtype at use, as transformers does
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q [T, Hq, D], k [T, Hkv, D]; positions [T] int64
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def at(self, positions: torch.Tensor, dtype: torch.dtype, cpu_ops: bool = False) -> PositionedRotary:
        """The tables gathered once for this step's positions, for every layer to reuse."""
        return PositionedRotary(self.cos[positions].to(dtype), self.sin[positions].to(dtype), cpu_ops)


class PositionedRotary:
    """RoPE for one step's positions: a drop-in for `RotaryEmbedding` inside the layers (same
    call), with cos/sin gathered once per forward instead of once per layer.

    rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi] exactly (the two halves of the
    table are equal, and negating is exact), so results are bit-identical to `RotaryEmbedding`."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, cpu_ops: bool = False) -> None:
        """`cpu_ops`: rotate with the fused C++ op of kernels/cpu_elementwise.py."""
        half = cos.shape[-1] // 2
        self.half = half
        self.cpu_ops = cpu_ops
        self.cos_rows = cos  # [T, D], the activation dtype (the C++ op's layout)
        self.signed_sin_rows = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # [T, D]
        self.cos = cos[:, None, :]  # [T, 1, D]
        self.signed_sin = self.signed_sin_rows[:, None, :]  # [T, 1, D]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] -> rotated [T, H, D] (a new tensor)."""
        if self.cpu_ops:
            return cpu_elementwise.rotary(x, self.cos_rows, self.signed_sin_rows)
        return x * self.cos + x.roll(self.half, dims=-1) * self.signed_sin

    def __call__(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotate(q), self.rotate(k)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Linear(nn.Module):
    """y = x W^T (+ b). `shard_sizes` splits the output rows into the checkpoint tensors fused
    into this layer (q/k/v, gate/up), each loaded by `load_shard`."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.shard_sizes = list(shard_sizes)
        out = sum(shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None

    def shard_slice(self, shard: int) -> slice:
        start = sum(self.shard_sizes[:shard])
        return slice(start, start + self.shard_sizes[shard])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


_kernel_rows_only = False  # set inside `quantized_kernels_only`


@contextmanager
def quantized_kernels_only(enabled: bool = True) -> Iterator[None]:
    """Inside the block, the int8/int4 linears run their own kernel whatever the rows, never their
    dense copies, and the one-op int4 layers take every row count (DecoderLayer.forward).

    Why: a speculative verify step's k + 1 rows (or several requests' rows) can pass the row count
    where the dense copies take over, and the dense GEMM sums in another order than the kernel, so a
    verified row could differ in its last bits from the one-row step that produced the same token
    without speculation and flip a greedy choice. Our CPU kernels compute each row alone (its bits do
    not depend on the rows beside it), so on them verification is exact. The engine's step runs its
    verify steps without prefill chunks inside this block (engine/model_runner.py)."""
    global _kernel_rows_only
    before = _kernel_rows_only
    _kernel_rows_only = enabled
    try:
        yield
    finally:
        _kernel_rows_only = before


def kernels_only() -> bool:
    """Whether the caller runs inside `quantized_kernels_only`."""
    return _kernel_rows_only
